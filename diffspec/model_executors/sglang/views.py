"""The diffusion view shared by diffspec's SGLang model classes (Orthrus, NLD).

A self-speculative model in SGLang *is* SGLang's own causal model (the AR view: its
layers, its radix attention, its KV pool); plain requests and every verify pass run it
unchanged. The diffusion view runs the same embeddings, layer norms, MLPs, final norm and
LM head, and swaps only each layer's attention for the method's draft attention (Orthrus:
the ``*_diff`` projections and q/k norms; NLD: the same projections plus the draft LoRA).

Draft attention reads the committed prefix's AR K/V straight out of SGLang's token-to-KV
pool (the slots ``req_to_token`` maps the request's positions to) and attends to it and
to the whole block, non-causally. It uses torch operations only (gather + scaled dot
product attention), so it runs the same on CPU and GPU with any attention backend, and it
writes nothing: the block's K/V are never stored, exactly as in the reference, so no draft
state can reach the pool or the radix cache.

Under tensor parallelism each rank runs the view on its own heads and shards, as SGLang's
forward does. SGLang's decoder layers build ``o_proj`` and ``mlp.down_proj`` with
``reduce_results=False`` and sum the shards at the layer's stage boundaries, which the
view does not run, so the view all-reduces those outputs itself (:func:`full_output`);
the draft logits are the LM head's vocabulary shards, all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.distributed import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.runtime_context import get_parallel
from torch import nn

__all__ = ["DiffusionViewMixin", "DraftBlocks", "full_output"]


@dataclass
class DraftBlocks:
    """One diffusion-view forward over ``B`` blocks of ``width`` tokens each."""

    input_ids: torch.Tensor  # [B * width] blocks [anchor, <mask> x (width - 1)], concatenated
    positions: torch.Tensor  # [B * width] positions start_b .. start_b + width - 1
    prefix_slots: list[torch.Tensor]  # B x [start_b] KV-pool slots of each committed prefix
    width: int
    kv_pool: object  # SGLang's token-to-KV pool (get_key_buffer / get_value_buffer)

    @property
    def num_blocks(self) -> int:
        return len(self.prefix_slots)


class DiffusionViewMixin:
    """Adds :meth:`diffusion_hidden_states` / :meth:`diffusion_logits` to an SGLang
    ``*ForCausalLM`` whose subclass implements :meth:`_draft_qkv` and :meth:`_draft_out`."""

    config: object
    model: nn.Module
    lm_head: nn.Module
    draft_logits_shift: bool  # True: block position j predicts token j + 1

    def _draft_qkv(
        self,
        attn: nn.Module,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, Hq*D], k, v [T, Hkv*D]
        raise NotImplementedError

    def _draft_out(self, attn: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """``heads`` [T, Hq*D] (this rank's heads) -> [T, hidden]: the draft output
        projection, summed over the tensor-parallel ranks."""
        raise NotImplementedError

    def _draft_attention(
        self,
        attn: nn.Module,
        blocks: DraftBlocks,
        hidden: torch.Tensor,  # [T, hidden]
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self._draft_qkv(attn, blocks.positions, hidden)
        radix = attn.attn  # the layer's RadixAttention: head counts, scaling, layer id
        hq, hkv, dim = radix.tp_q_head_num, radix.tp_k_head_num, radix.head_dim
        w = blocks.width
        q = q.view(blocks.num_blocks, w, hq, dim).transpose(1, 2)  # [B, Hq, W, D]
        k = k.view(blocks.num_blocks, w, hkv, dim)  # [B, W, Hkv, D]
        v = v.view(blocks.num_blocks, w, hkv, dim)
        k_pool = blocks.kv_pool.get_key_buffer(radix.layer_id)  # [slots, Hkv, D]
        v_pool = blocks.kv_pool.get_value_buffer(radix.layer_id)
        out = torch.empty_like(q)  # [B, Hq, W, D]
        for b, slots in enumerate(blocks.prefix_slots):
            keys = torch.cat([k_pool[slots].to(k.dtype), k[b]]).transpose(0, 1)  # [Hkv, S, D]
            values = torch.cat([v_pool[slots].to(v.dtype), v[b]]).transpose(0, 1)
            out[b] = nn.functional.scaled_dot_product_attention(
                q[b][None], keys[None], values[None], scale=radix.scaling,
                enable_gqa=hq != hkv)[0]  # non-causal: every block token sees all keys
        heads = out.transpose(1, 2).reshape(blocks.num_blocks * w, hq * dim)  # [T, Hq*D]
        return self._draft_out(attn, heads)

    def diffusion_hidden_states(self, blocks: DraftBlocks) -> torch.Tensor:  # [T, hidden]
        """The diffusion view over ``blocks``: residual stream, norms and MLPs of the AR
        layers, draft attention in place of the causal one."""
        hidden = self.model.embed_tokens(blocks.input_ids)
        for i in range(self.model.start_layer, self.model.end_layer):
            layer = self.model.layers[i]
            hidden = hidden + self._draft_attention(
                layer.self_attn, blocks, layer.input_layernorm(hidden))
            mlp = layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = hidden + full_output(layer.mlp.down_proj, mlp)
        return self.model.norm(hidden)

    def diffusion_draft_logits(self, blocks: DraftBlocks) -> torch.Tensor:
        """Logits ``[B, width - 1, vocab]`` that predict the ``width - 1`` drafts of each
        block: block rows ``0 .. width - 2`` when shifted (Orthrus), ``1 .. width - 1``
        when not (NLD)."""
        hidden = self.diffusion_hidden_states(blocks).view(blocks.num_blocks, blocks.width, -1)
        hidden = hidden[:, :-1] if self.draft_logits_shift else hidden[:, 1:]
        # the head's rows are this rank's vocabulary shard (ParallelLMHead): gather them,
        # in rank order, as SGLang's LogitsProcessor does for the AR logits
        logits = torch.matmul(hidden, self.lm_head.weight.t())  # [B, W - 1, padded vocab / tp]
        if get_parallel().tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits.contiguous(), dim=-1)
        return logits[..., : self.config.vocab_size].float()  # drop the head's padding rows


def full_output(linear: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The whole output of an SGLang ``RowParallelLinear`` from this rank's ``out``: its
    all-reduce over the tensor-parallel group when the layer was built with
    ``reduce_results=False`` (its caller sums the shards), ``out`` itself when the layer
    reduced it or there is one rank."""
    if getattr(linear, "reduce_results", True) or get_parallel().tp_size == 1:
        return out
    return tensor_model_parallel_all_reduce(out)
