"""The diffusion LMs Fast-dLLM decodes, on vLLM's diffusion path (``--diffusion-config``,
the V2 model runner): vLLM's own Llama / Qwen2 / Ministral3 layers, each naming its model
state (:class:`diffspec.spec_workers.vllm.fast_dllm.FastDLLMModelState`).

Design notes: docs/design/vllm.md (section ``diffspec/model_executors/vllm/dllm.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from diffspec.core.checkpoint import CheckpointError

__all__ = ["DreamModel", "FastDLLMModel", "FastDLLMQwenForCausalLM", "LLaDAModelLM",
           "fast_dllm_model_state_cls", "llada_to_vllm_name"]


def fast_dllm_model_state_cls() -> type:
    """The model state of every Fast-dLLM model (imported lazily: it needs the V2 runner's
    modules, which the V1 runner never imports)."""
    from diffspec.spec_workers.vllm.fast_dllm import FastDLLMModelState

    return FastDLLMModelState


class FastDLLMModel:
    """Mixin for a vLLM ``*ForCausalLM`` served on the diffusion path.

    With ``vllm_config.diffusion_config`` set (always, for a diffusion-only family: the
    plugin's config hook sets it): ``get_model_state_cls`` names the Fast-dLLM model state
    (vLLM's V2 runner asks the model for it, as for DiffusionGemma), and for a shifted
    family ``forward`` copies its hidden states into ``fast_dllm_hidden``. Without it (a
    plain causal run, e.g. NLD's AR view) the model is its base class unchanged."""

    fast_dllm_hidden: torch.Tensor | None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self.fast_dllm_hidden = None
        if vllm_config.diffusion_config is None:
            return
        # an instance attribute: vLLM's V2 runner checks hasattr(model, "get_model_state_cls")
        self.get_model_state_cls = fast_dllm_model_state_cls
        options = _fast_dllm_options(vllm_config)
        if options.get("logits_shift"):
            hidden_size = vllm_config.model_config.get_hidden_size()
            rows = max(vllm_config.scheduler_config.max_num_batched_tokens, 1)
            self.fast_dllm_hidden = torch.zeros(rows, hidden_size,
                                                dtype=vllm_config.model_config.dtype)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        out = super().forward(input_ids, positions, intermediate_tensors,  # type: ignore[misc]
                              inputs_embeds, **kwargs)
        buffer = self.fast_dllm_hidden
        if buffer is not None and isinstance(out, torch.Tensor):
            n = min(out.shape[0], buffer.shape[0])
            buffer[:n].copy_(out[:n])
        return out


def _fast_dllm_options(vllm_config: VllmConfig) -> dict[str, Any]:
    """The Fast-dLLM settings the plugin's config hook resolved
    (``additional_config["diffspec"]["fast_dllm"]``)."""
    extra = vllm_config.additional_config
    if not isinstance(extra, dict):
        return {}
    return dict((extra.get("diffspec") or {}).get("fast_dllm") or {})


# ---------------------------------------------------------------------------- LLaDA

_BLOCK = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_NAMES = {"model.transformer.wte.weight": "model.embed_tokens.weight",
              "model.transformer.ln_f.weight": "model.norm.weight",
              "model.transformer.ff_out.weight": "lm_head.weight"}


def llada_to_vllm_name(name: str) -> str:
    """The vLLM Llama parameter name of an LLaDA checkpoint tensor:

    =================================  ========================================
    checkpoint (``model.transformer.``)  vLLM
    =================================  ========================================
    ``wte``                            ``model.embed_tokens``
    ``blocks.N.attn_norm``             ``model.layers.N.input_layernorm``
    ``blocks.N.{q,k,v}_proj``          ``model.layers.N.self_attn.{q,k,v}_proj``
    ``blocks.N.attn_out``              ``model.layers.N.self_attn.o_proj``
    ``blocks.N.ff_norm``               ``model.layers.N.post_attention_layernorm``
    ``blocks.N.ff_proj`` / ``up_proj`` ``model.layers.N.mlp.gate_proj`` / ``up_proj``
    ``blocks.N.ff_out``                ``model.layers.N.mlp.down_proj``
    ``ln_f``                           ``model.norm``
    ``ff_out``                         ``lm_head``
    =================================  ========================================

    (vLLM's loader then packs q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``.)
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise CheckpointError(f"unexpected LLaDA tensor {name!r}: the LLaDA layout "
                              f"(block_type llama) has no such tensor")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


class LLaDAModelLM(FastDLLMModel, LlamaForCausalLM):
    """vLLM's Llama with LLaDA's checkpoint layout (unshifted logits)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield llada_to_vllm_name(name), tensor

        return super().load_weights(renamed())


# ---------------------------------------------------------------------------- Qwen2.5


class DreamModel(FastDLLMModel, Qwen2ForCausalLM):
    """Dream (``DreamModel``): vLLM's Qwen2 (its tensors are Qwen2.5's; shifted logits)."""


class FastDLLMQwenForCausalLM(FastDLLMModel, Qwen2ForCausalLM):
    """Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``): vLLM's Qwen2 (Qwen2.5 tensors, shifted
    logits, trained block ``bd_size``, decoded in sub-blocks)."""
