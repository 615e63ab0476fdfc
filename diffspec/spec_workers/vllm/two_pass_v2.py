"""vLLM V2 model runner speculator for the two-pass self-speculative step (Orthrus, NLD
linear): the V1 drafter of :mod:`~diffspec.spec_workers.vllm.two_pass` as a speculator of
vLLM's V2 runner (``vllm/v1/worker/gpu/``), built by ``init_speculator`` (patch
``v2_speculator``) as vLLM builds its EAGLE / DFlash / n-gram speculators there.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/two_pass_v2.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from diffspec.spec_workers.vllm.proposer import (
    DRAFT_LOGITS_ROWS,
    NonCausalBlocks,
    draft_argmax,
    non_causal_metadata,
)
from diffspec.spec_workers.vllm.speculator import SelfSpeculator
from diffspec.spec_workers.vllm.two_pass import chunks, plan_v2_blocks

__all__ = ["TwoPassSpeculator"]


class TwoPassSpeculator(SelfSpeculator):
    """The diffusion view of the served model as the V2 runner's speculator: after each
    verify (vLLM's forward, sampler and rejection sampler), one non-causal forward of the
    blocks ``[anchor, <mask> x n]`` over the runner's own paged KV cache drafts the next
    step's tokens (point masses: vLLM's rejection sampler verifies them losslessly)."""

    def __init__(self, vllm_config, device: torch.device, req_states, method: str) -> None:
        # num_forwards counts the diffusion view's forwards
        super().__init__(vllm_config, device, req_states, method)
        self.max_forward_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens,
                                      self.num_speculative_steps + 1)

    def load_model(self, target_model) -> None:
        """The target model, whose diffusion view drafts (its block lengths vary per
        request: eager)."""
        if not hasattr(target_model, "diffusion_hidden_states"):
            raise TypeError(f"method {self.method!r} needs a model with a diffusion view; "
                            f"{type(target_model).__name__} has none (check config.json "
                            f"architectures)")
        super().load_model(target_model)

    # ------------------------------------------------------------ each step

    def _fill_drafts(self, drafts: torch.Tensor, input_batch, anchors: torch.Tensor,
                     num_sampled: list[int], k: int) -> None:
        """The drafts of each request's block ``[anchor, <mask> x n]``; past its block (or
        with no block) its row keeps the anchor."""
        idx = input_batch.idx_mapping[:input_batch.num_reqs]  # [num_reqs] request-state rows
        positions = self.req_states.num_computed_tokens.gpu[idx].tolist()  # anchor positions
        plan = plan_v2_blocks(num_sampled, positions, self._num_slots(input_batch).tolist(), k,
                              self.max_model_len)
        for chunk in chunks(plan, self.max_forward_tokens):
            rows = [b.row for b in chunk]
            tokens = self._draft(idx[rows], anchors[rows], [b.start for b in chunk],
                                 np.array([b.num_drafts + 1 for b in chunk], dtype=np.int32))
            if tokens is None:
                continue
            at = 0
            for block in chunk:
                n = block.num_drafts
                drafts[block.row, :n] = torch.tensor(tokens[at:at + n], dtype=drafts.dtype)
                at += n

    def _draft(self, req_rows: torch.Tensor, anchors: torch.Tensor, starts: list[int],
               lengths: np.ndarray) -> list[int] | None:
        """One diffusion-view forward over the blocks of request-state rows ``req_rows``
        (block ``i``: ``anchors[i]`` then masks, at positions ``starts[i] ..``); the draft
        token ids of all blocks in order (``None`` on a rank without gathered logits)."""
        from vllm.forward_context import set_forward_context

        table = self.block_tables.block_tables[0].gpu[req_rows]  # [B, max blocks]
        batch: NonCausalBlocks = non_causal_metadata(
            self.target_attn_groups[0], table, self.block_tables.block_sizes[0], starts,
            lengths, self.method, self.device)
        input_ids = torch.full((batch.num_tokens,), self.mask_token_id, dtype=torch.int64,
                               device=self.device)
        input_ids[torch.from_numpy(batch.query_start[:-1]).to(self.device)] = anchors
        shift = 0 if self.model.draft_logits_shift else 1  # block row predicting draft 1
        predict = np.concatenate([np.arange(n - 1) + s + shift
                                  for n, s in zip(lengths, batch.query_start)])
        layer_slots = dict.fromkeys(batch.attn_metadata, batch.slot_mapping)
        with set_forward_context(batch.attn_metadata, self.vllm_config,
                                 num_tokens=batch.num_tokens, slot_mapping=layer_slots):
            hidden = self.model.diffusion_hidden_states(input_ids, batch.positions)
        self.num_forwards += 1
        return draft_argmax(self.model, hidden, torch.from_numpy(predict).to(self.device),
                            DRAFT_LOGITS_ROWS)
