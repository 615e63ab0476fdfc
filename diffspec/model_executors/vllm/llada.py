"""LLaDA (``LLaDAModelLM``) in vLLM: vLLM's own ``LlamaForCausalLM`` with LLaDA's tensor
names, served on vLLM's diffusion path with Fast-dLLM decoding
(:class:`diffspec.spec_workers.vllm.fast_dllm.FastDLLMModelState`, returned by
:meth:`LLaDAModelLM.get_model_state_cls` as ``DiffusionGemmaForConditionalGeneration``
returns its own).

LLaDA's ``block_type: llama`` layer is a Llama layer (RMSNorm, half-split RoPE with
``rope_theta``, SwiGLU ``ff_out(silu(ff_proj(x)) * up_proj(x))``, no biases); its config
(:class:`diffspec.plugin.hf_configs.LLaDAConfig`) reads the OLMo key names as the Llama
ones. Attention causality is the model state's business (per request: causal prefill,
non-causal blocks), so the layers are vLLM's unchanged. Logits are unshifted.

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from diffspec.core.checkpoint import CheckpointError

__all__ = ["LLaDAModelLM", "llada_to_vllm_name"]

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
    """The vLLM Llama parameter name of an LLaDA checkpoint tensor (table above)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise CheckpointError(f"unexpected LLaDA tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


class LLaDAModelLM(LlamaForCausalLM):
    """vLLM's Llama with LLaDA's checkpoint layout, decoded by Fast-dLLM."""

    @staticmethod
    def get_model_state_cls() -> type:
        from diffspec.spec_workers.vllm.fast_dllm import FastDLLMModelState

        return FastDLLMModelState

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield llada_to_vllm_name(name), tensor

        return super().load_weights(renamed())
