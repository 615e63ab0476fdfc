"""Nemotron-Labs-Diffusion (NLD) in SGLang: SGLang's own Ministral3 as the AR view, plus
the drafter LoRA used only by the diffusion view.

Design notes: docs/design/sglang.md (section ``diffspec/model_executors/sglang/nld.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from sglang.srt.layers.linear import ReplicatedLinear, RowParallelLinear
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.ministral3 import (
    Ministral3Attention,
    Ministral3ForCausalLM,
    _get_llama_4_attn_scale,
)
from sglang.srt.utils import add_prefix

from diffspec.core.checkpoint import LORA_DIR, CheckpointError
from diffspec.model_executors.reference.nld_weights import (
    lora_folder,
    lora_rank_and_scaling,
    lora_weights,
    renamed_weights,
)
from diffspec.model_executors.sglang.dllm import block_attention, dllm_mode
from diffspec.model_executors.sglang.views import DiffusionViewMixin, full_output

__all__ = ["NemotronLabsDiffusionForCausalLM"]

logger = logging.getLogger("diffspec")


class NemotronLabsDiffusionForCausalLM(DiffusionViewMixin, Ministral3ForCausalLM):
    """SGLang's Ministral3 with NLD's checkpoint layout and its draft-only LoRA."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.draft_logits_shift = getattr(config, "dlm_type", None) == "dream"
        self.lora_path = lora_folder(getattr(config, "_name_or_path", ""))
        self.lora_scaling = 0.0
        if dllm_mode():  # diffusion mode: the LoRA belongs to self-speculation's drafts
            self.lora_path = None
            block_attention(self)
        elif self.lora_path is not None:
            rank, self.lora_scaling = lora_rank_and_scaling(self.lora_path)
            for i in range(self.model.start_layer, self.model.end_layer):
                _add_lora(self.model.layers[i].self_attn, rank,
                          add_prefix(f"layers.{i}.self_attn", add_prefix("model", prefix)))
            logger.info("diffspec: NLD drafter LoRA from %s (r=%d, scaling=%g)",
                        self.lora_path, rank, self.lora_scaling)
        else:
            logger.warning("diffspec: %s has no %s/; the diffusion view drafts with the plain "
                           "backbone", getattr(config, "_name_or_path", "?"), LORA_DIR)

    def _draft_qkv(
        self,
        attn: Ministral3Attention,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv, _ = attn.qkv_proj(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        if attn.llama_4_scaling_beta is not None:
            scale = _get_llama_4_attn_scale(positions, attn.llama_4_scaling_beta,
                                            attn.max_position_embeddings).to(q.dtype)  # [T, 1]
            q = (q.view(-1, attn.num_heads, attn.head_dim) * scale[:, None]).reshape(q.shape)
        return q, k, v

    def _draft_out(self, attn: Ministral3Attention, heads: torch.Tensor) -> torch.Tensor:
        out, _ = attn.o_proj(heads)  # this rank's share
        if self.lora_path is not None:
            low_rank, _ = attn.o_proj_lora_a(heads)  # this rank's share of lora_a(x)
            delta, _ = attn.o_proj_lora_b(low_rank)
            out = out + self.lora_scaling * delta
        return full_output(attn.o_proj, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        lora = list(lora_weights(self.lora_path))
        for name, tensor in lora:  # each layer's loader takes this rank's shard
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype))
        missing = sorted(n for n in params if "_lora_" in n and n not in dict(lora))
        if missing:
            raise CheckpointError(f"{self.lora_path}: no LoRA tensor for {missing[0]}")
        return super().load_weights(renamed_weights(weights))


def _add_lora(attn: Ministral3Attention, rank: int, prefix: str) -> None:
    """``o_proj``'s low-rank update (unquantized), sharded like ``o_proj``."""
    attn.o_proj_lora_a = RowParallelLinear(
        attn.total_num_heads * attn.head_dim, rank, bias=False, quant_config=None,
        parallel_group=attn.o_proj.parallel_group, reduce_results=False,
        prefix=add_prefix("o_proj_lora_a", prefix))
    attn.o_proj_lora_b = ReplicatedLinear(
        rank, attn.hidden_size, bias=False, quant_config=None,
        prefix=add_prefix("o_proj_lora_b", prefix))
