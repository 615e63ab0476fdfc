"""Nemotron-Labs-Diffusion (NLD) in vLLM: vLLM's own Ministral3 (``MistralForCausalLM``)
as the AR view, plus the drafter LoRA used only by the diffusion view.

Design notes: docs/design/vllm.md (section ``diffspec/model_executors/vllm/nld.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear, RowParallelLinear
from vllm.model_executor.models.mistral import MistralAttention, MistralForCausalLM

from diffspec.model_executors.reference.nld_weights import (
    lora_folder,
    lora_rank_and_scaling,
    lora_weights,
    renamed_weights,
)
from diffspec.model_executors.vllm.dllm import FastDLLMModel
from diffspec.model_executors.vllm.views import DiffusionViewMixin

__all__ = ["NemotronLabsDiffusionForCausalLM"]


class NemotronLabsDiffusionForCausalLM(FastDLLMModel, DiffusionViewMixin, MistralForCausalLM):
    """vLLM's Ministral3 with NLD's checkpoint layout and its draft-only LoRA (and, under
    ``--diffusion-config``, NLD's diffusion mode: :class:`FastDLLMModel`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("llama_4_scaling_beta") is not None:
            config.llama_4_scaling = {
                "original_max_position_embeddings": rope["original_max_position_embeddings"],
                "beta": rope["llama_4_scaling_beta"],
            }
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.draft_logits_shift = getattr(config, "dlm_type", None) == "dream"
        self.lora_path = lora_folder(vllm_config.model_config.model)
        self.lora_scaling = 0.0
        if self.lora_path is not None:
            rank, self.lora_scaling = lora_rank_and_scaling(self.lora_path)
            for layer in self._layers():
                _add_lora(layer.self_attn, rank)

    def _draft_attention(
        self,
        attn: MistralAttention,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Mistral attention through the layer's own paged ``Attention``, LoRA on ``o_proj``."""
        qkv, _ = attn.qkv_proj(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        if attn.do_llama_4_scaling:
            q = (q * attn._get_llama_4_attn_scale(positions)).to(q.dtype)
        heads = attn.attn(q, k, v)
        out, _ = attn.o_proj(heads)
        if self.lora_path is not None:
            low_rank, _ = attn.o_proj_lora_a(heads)
            delta, _ = attn.o_proj_lora_b(low_rank)
            out = out + self.lora_scaling * delta
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(chain(renamed_weights(weights), lora_weights(self.lora_path)))


def _add_lora(attn: MistralAttention, rank: int) -> None:
    """``o_proj``'s low-rank update (unquantized), sharded like ``o_proj`` under tensor
    parallelism."""
    prefix = attn.attn.layer_name.rsplit(".", 1)[0]  # model.layers.N.self_attn
    attn.o_proj_lora_a = RowParallelLinear(
        attn.total_num_heads * attn.head_dim, rank, bias=False, quant_config=None,
        prefix=f"{prefix}.o_proj_lora_a")
    attn.o_proj_lora_b = ReplicatedLinear(
        rank, attn.hidden_size, bias=False, quant_config=None, prefix=f"{prefix}.o_proj_lora_b")
