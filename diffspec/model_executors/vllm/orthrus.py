"""Orthrus in vLLM: vLLM's own Qwen3 or Llama (the AR view) plus per-layer diffusion
attention.

Design notes: docs/design/vllm.md (section ``diffspec/model_executors/vllm/orthrus.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from diffspec.core.checkpoint import orthrus_weights_missing
from diffspec.model_executors.vllm.views import DiffusionViewMixin

__all__ = ["OrthrusForCausalLM", "OrthrusLlamaForCausalLM"]


class _OrthrusMixin(DiffusionViewMixin):
    """The Orthrus part shared by both bases: build the ``*_diff`` twins of every layer's
    attention, draft through them, and refuse a checkpoint without them."""

    draft_logits_shift = True  # block position j predicts token j + 1
    config: object

    def _add_diffusion_modules(self, vllm_config: VllmConfig) -> None:
        for layer in self._layers():
            _add_diffusion_projections(layer.self_attn, self.config.rms_norm_eps,
                                       vllm_config.quant_config)

    def _draft_attention(
        self,
        attn: nn.Module,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return _diffusion_attention(attn, positions, hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)  # type: ignore[misc]
        missing = sorted(n for n, _ in self.named_parameters() if "_diff." in n and n not in loaded)
        if missing:
            raise orthrus_weights_missing(
                missing, "parameters", norms=any("_norm_diff." in n for n in missing))
        return loaded


class OrthrusForCausalLM(_OrthrusMixin, Qwen3ForCausalLM):
    """vLLM's Qwen3 with Orthrus's diffusion attention projections and q/k norms in every
    layer (``OrthrusLM`` / ``OrthrusForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._add_diffusion_modules(vllm_config)


class OrthrusLlamaForCausalLM(_OrthrusMixin, LlamaForCausalLM):
    """vLLM's Llama with Orthrus's diffusion attention projections in every layer
    (``OrthrusLlamaForCausalLM``, ``model_type: "llama"``; e.g. on SmolLM2)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._add_diffusion_modules(vllm_config)


def _add_diffusion_projections(attn: nn.Module, eps: float, quant_config) -> None:
    """Give ``attn`` the ``*_diff`` twins of its projections (biases as the AR ones have
    them) and, when it has q/k norms (Qwen3), of those."""
    prefix = attn.attn.layer_name.rsplit(".", 1)[0]  # model.layers.N.self_attn
    attn.qkv_proj_diff = QKVParallelLinear(
        attn.hidden_size, attn.head_dim, attn.total_num_heads, attn.total_num_kv_heads,
        bias=attn.qkv_proj.bias is not None, quant_config=quant_config,
        prefix=f"{prefix}.qkv_proj_diff")
    attn.o_proj_diff = RowParallelLinear(
        attn.total_num_heads * attn.head_dim, attn.hidden_size,
        bias=attn.o_proj.bias is not None, quant_config=quant_config,
        prefix=f"{prefix}.o_proj_diff")
    if hasattr(attn, "q_norm"):
        attn.q_norm_diff = RMSNorm(attn.head_dim, eps=eps)
        attn.k_norm_diff = RMSNorm(attn.head_dim, eps=eps)


def _diffusion_attention(
    attn: nn.Module,
    positions: torch.Tensor,  # [num_tokens]
    hidden: torch.Tensor,  # [num_tokens, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    """The layer's attention with the ``*_diff`` projections (and norms), through the
    layer's own paged ``Attention`` (its K/V go to the forward context's slots)."""
    qkv, _ = attn.qkv_proj_diff(hidden)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    if hasattr(attn, "q_norm_diff"):
        q = attn.q_norm_diff(q.view(*q.shape[:-1], -1, attn.head_dim)).view(q.shape)
        k = attn.k_norm_diff(k.view(*k.shape[:-1], -1, attn.head_dim)).view(k.shape)
    q, k = attn.rotary_emb(positions, q, k)
    out, _ = attn.o_proj_diff(attn.attn(q, k, v))
    return out
