"""The diffusion view shared by diffspec's SGLang model classes (Orthrus, NLD).

Design notes: docs/design/sglang.md (section ``diffspec/model_executors/sglang/views.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from sglang.srt.distributed import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.srt.runtime_context import get_parallel
from torch import nn

__all__ = ["LOGITS_ROWS", "DiffusionViewMixin", "DraftBlocks", "argmax_in_chunks", "full_output"]

# Rows of fp32 logits diffspec's SGLang passes materialise at once (issue 29, row 8): the
# draft logits here, the verify rows' and TIDAR's branch rows' in
# diffspec/spec_workers/sglang/target_worker.py (``StepLogits``). Whole, they would be every
# step row x vocabulary, outside SGLang's memory accounting (TIDAR: (n + 1)(1 + K') rows per
# request; 48 requests x 72 rows x 151936 x 4 bytes: 2.1 GB); in chunks at most
# LOGITS_ROWS x vocab (1024 x 151936 x 4 bytes: 622 MB), or one request's verify rows if
# they are more. Read at each call (a test sets it small).
LOGITS_ROWS = 1024


@dataclass
class DraftBlocks:
    """One diffusion-view forward over ``B`` blocks of ``width`` tokens each."""

    input_ids: torch.Tensor  # [B * width] blocks [anchor, <mask> x (width - 1)], concatenated
    positions: torch.Tensor  # [B * width] positions start_b .. start_b + width - 1
    width: int
    forward_batch: object  # SGLang's ForwardBatch of the blocks, attention metadata ready

    @property
    def num_blocks(self) -> int:
        return self.input_ids.shape[0] // self.width


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
        q, k, v = self._draft_qkv(attn, blocks.positions, hidden)  # [T, H*D] each
        heads = _non_causal_twin(attn.attn)(q, k, v, blocks.forward_batch)  # [T, Hq*D]
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
        when not (NLD). All at once: the worker drafts with :meth:`diffusion_draft_tokens`."""
        hidden = self._draft_hidden(blocks)  # [B, W - 1, hidden]
        return self._draft_head(hidden.reshape(-1, hidden.shape[-1])).view(
            *hidden.shape[:2], -1)

    def diffusion_draft_tokens(self, blocks: DraftBlocks) -> torch.Tensor:
        """The greedy drafts ``[B, width - 1]``: the argmax of :meth:`diffusion_draft_logits`,
        computed :data:`LOGITS_ROWS` rows at a time."""
        hidden = self._draft_hidden(blocks)  # [B, W - 1, hidden]
        return argmax_in_chunks(self._draft_head, hidden.reshape(-1, hidden.shape[-1])).view(
            hidden.shape[:2])

    def _draft_hidden(self, blocks: DraftBlocks) -> torch.Tensor:  # [B, W - 1, hidden]
        hidden = self.diffusion_hidden_states(blocks).view(blocks.num_blocks, blocks.width, -1)
        return hidden[:, :-1] if self.draft_logits_shift else hidden[:, 1:]

    def _draft_head(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab]
        # the head's rows are this rank's vocabulary shard (ParallelLMHead): gather them,
        # in rank order, as SGLang's LogitsProcessor does for the AR logits
        logits = torch.matmul(hidden, self.lm_head.weight.t())  # [R, padded vocab / tp]
        if get_parallel().tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits.contiguous(), dim=-1)
        return logits[..., : self.config.vocab_size].float()  # drop the head's padding rows


def argmax_in_chunks(logits_of, hidden: torch.Tensor,
                     rows: int | None = None) -> torch.Tensor:  # [R] int64
    """``logits_of(hidden).argmax(-1)`` for ``hidden`` ``[R, hidden]``, computed ``rows``
    rows at a time (default :data:`LOGITS_ROWS`, read now): at most ``rows x vocab`` logits
    exist at once. Every tensor-parallel rank makes the same calls (the same rows)."""
    rows = LOGITS_ROWS if rows is None else rows
    if hidden.shape[0] <= rows:
        return logits_of(hidden).argmax(dim=-1)
    return torch.cat([logits_of(hidden[i:i + rows]).argmax(dim=-1)
                      for i in range(0, hidden.shape[0], rows)])


def full_output(linear: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The whole output of an SGLang ``RowParallelLinear`` from this rank's ``out``: its
    all-reduce over the tensor-parallel group when the layer was built with
    ``reduce_results=False`` (its caller sums the shards), ``out`` itself when the layer
    reduced it or there is one rank."""
    if getattr(linear, "reduce_results", True) or get_parallel().tp_size == 1:
        return out
    return tensor_model_parallel_all_reduce(out)


def _non_causal_twin(radix: nn.Module) -> nn.Module:
    """The layer's ``RadixAttention`` as ``AttentionType.ENCODER_ONLY`` (made once, kept on
    the layer): same layer id, head counts, scaling and KV buffers, so the backend attends
    non-causally over the pool and writes K/V where the forward batch says."""
    twin = radix.__dict__.get("_diffspec_non_causal")
    if twin is None:
        from sglang.srt.layers.radix_attention import AttentionType

        twin = copy.copy(radix)  # shares the module's state; only attn_type differs
        twin.attn_type = AttentionType.ENCODER_ONLY
        radix.__dict__["_diffspec_non_causal"] = twin  # not a submodule: no weights
    return twin
