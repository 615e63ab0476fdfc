"""The diffusion LMs Fast-dLLM decodes, in SGLang's dLLM mode: SGLang's own Llama / Qwen2
with block attention (the SGLang side of :mod:`diffspec.model_executors.reference.dllm`).

Design notes: docs/design/sglang.md (section ``diffspec/model_executors/sglang/dllm.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.qwen2 import Qwen2ForCausalLM

from diffspec.core.checkpoint import CheckpointError

__all__ = ["DreamModel", "FastDLLMQwenForCausalLM", "LLaDAModelLM", "block_attention",
           "dllm_mode", "llada_to_llama_name"]

# LLaDA block tensor -> SGLang Llama layer tensor
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_NAMES = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
_BLOCK = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)")
_TOP = re.compile(r"model\.transformer\.(\w+)\.weight")


def llada_to_llama_name(name: str) -> str | None:
    """The SGLang Llama name of an LLaDA checkpoint tensor, or ``None`` if it has none."""
    if m := _BLOCK.fullmatch(name):
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}" if part in _BLOCK_NAMES else None
    if m := _TOP.fullmatch(name):
        return f"{_TOP_NAMES[m.group(1)]}.weight" if m.group(1) in _TOP_NAMES else None
    return None


def block_attention(model) -> None:
    """Make an SGLang causal LM a dLLM block model: non-causal attention, full logits."""
    layers = model.model.layers[model.model.start_layer : model.model.end_layer]
    for layer in layers:
        layer.self_attn.attn.attn_type = AttentionType.ENCODER_ONLY
    model.logits_processor = LogitsProcessor(model.config, return_full_logits=True)


def dllm_mode() -> bool:
    """True in an SGLang launched with ``--dllm-algorithm`` (its model is a dLLM)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().dllm.dllm_algorithm is not None


class LLaDAModelLM(LlamaForCausalLM):
    """SGLang's Llama with block attention, reading LLaDA's checkpoint layout."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        block_attention(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        return super().load_weights(self._renamed(weights))

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        path = getattr(self.config, "_name_or_path", "")
        for name, tensor in weights:
            renamed = llada_to_llama_name(name)
            if renamed is None:
                raise CheckpointError(
                    f"checkpoint {path} holds tensor {name!r}, which the LLaDA layout "
                    f"(block_type llama) does not have")
            yield renamed, tensor


class DreamModel(Qwen2ForCausalLM):
    """Dream: SGLang's Qwen2 with block attention (its tensors are Qwen2.5's)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        block_attention(self)


class FastDLLMQwenForCausalLM(Qwen2ForCausalLM):
    """Fast-dLLM v2 (``Fast_dLLM_QwenForCausalLM``): SGLang's Qwen2 with block attention."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        block_attention(self)
