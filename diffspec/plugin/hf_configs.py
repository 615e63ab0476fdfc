"""transformers config classes for the ``model_type`` names of checkpoints that the
published repos ship as remote code, so diffspec serves them with ``trust_remote_code``
off: ``orthrus`` (a Qwen3 config), ``nemotron_labs_diffusion`` (a Ministral3 config) and
``llada`` (LLaDA's OLMo-style names mapped onto the Llama ones the engines read), ``Dream``
and ``Fast_dLLM_Qwen`` (Qwen2 configs).
Extra keys (``block_size``, ``mask_token_id``, ...) stay attributes of the config.

They are registered with transformers' own ``AutoConfig.register`` from the engine
plugins' ``register()``; the classes live at module level so a pickled config (vLLM sends
it to its engine-core process) unpickles anywhere diffspec is installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import ClassVar

from transformers import (
    AutoConfig,
    Ministral3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

__all__ = ["DreamConfig", "FastDLLMQwenConfig", "LLaDAConfig", "NemotronLabsDiffusionConfig",
           "OrthrusConfig", "register_model_types"]


class OrthrusConfig(Qwen3Config):
    """Orthrus checkpoints whose config.json says ``model_type: "orthrus"``."""

    model_type = "orthrus"


class NemotronLabsDiffusionConfig(Ministral3Config):
    """Nemotron-Labs-Diffusion: a Ministral3 backbone (``model_type:
    "nemotron_labs_diffusion"``)."""

    model_type = "nemotron_labs_diffusion"


class LLaDAConfig(PretrainedConfig):
    """LLaDA (``model_type: "llada"``, ``GSAI-ML/LLaDA-8B-*``): its OLMo key names, read
    through the Llama names (``hidden_size`` is ``d_model``, ...). Only ``block_type:
    llama`` exists in the published checkpoints; the reference executor checks the rest
    (:func:`diffspec.model_executors.reference.dllm.llada_dims`)."""

    model_type = "llada"
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model", "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers", "intermediate_size": "mlp_hidden_size",
        "max_position_embeddings": "max_sequence_length", "tie_word_embeddings": "weight_tying",
    }

    def __init__(self, d_model: int = 4096, n_heads: int = 32, n_kv_heads: int | None = None,
                 n_layers: int = 32, mlp_hidden_size: int | None = None, mlp_ratio: int = 4,
                 vocab_size: int = 126464, embedding_size: int | None = None,
                 max_sequence_length: int = 4096, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-5, include_qkv_bias: bool = False,
                 weight_tying: bool = False, **kwargs) -> None:
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.n_kv_heads = n_kv_heads or n_heads
        self.num_key_value_heads = self.n_kv_heads
        self.mlp_hidden_size = mlp_hidden_size or mlp_ratio * d_model
        self.mlp_ratio = mlp_ratio
        self.embedding_size = embedding_size
        self.vocab_size = embedding_size or vocab_size  # rows of wte / ff_out
        self.max_sequence_length = max_sequence_length
        self.rope_theta, self.rms_norm_eps = rope_theta, rms_norm_eps
        self.include_qkv_bias = self.attention_bias = include_qkv_bias
        self.head_dim = d_model // n_heads
        self.hidden_act = "silu"
        self.weight_tying = weight_tying
        kwargs.pop("tie_word_embeddings", None)  # LLaDA's key is weight_tying
        super().__init__(tie_word_embeddings=weight_tying, **kwargs)


class DreamConfig(Qwen2Config):
    """Dream (``model_type: "Dream"``, ``Dream-org/Dream-v0-*``): a Qwen2.5 config."""

    model_type = "Dream"


class FastDLLMQwenConfig(Qwen2Config):
    """Fast-dLLM v2 (``model_type: "Fast_dLLM_Qwen"``): a Qwen2.5 config plus ``bd_size``."""

    model_type = "Fast_dLLM_Qwen"


def register_model_types(model_types: Mapping[str, str]) -> None:
    """``AutoConfig.register`` each ``model_type -> "module:Class"``; idempotent."""
    for model_type, target in model_types.items():
        module, name = target.split(":")
        config_class = getattr(importlib.import_module(module), name)
        AutoConfig.register(model_type, config_class, exist_ok=True)
