"""What diffspec's speculators for vLLM's V2 model runner share (the two-pass step of
:mod:`~diffspec.spec_workers.vllm.two_pass_v2`, TiDAR's of
:mod:`~diffspec.spec_workers.vllm.tidar_v2`): a ``DraftModelSpeculator`` whose drafter is
the served model itself, with no layers and no KV cache of its own, attending through the
target's layers, block tables and attention groups, eagerly.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/two_pass_v2.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from diffspec.spec_workers.vllm.proposer import one_kv_cache_group

__all__ = ["SelfSpeculator"]


class SelfSpeculator(DraftModelSpeculator):
    """The V2 runner's speculator for a self-speculative ``method`` (module docstring);
    subclasses draft in :meth:`_fill_drafts` and add what their method wraps."""

    def __init__(self, vllm_config, device: torch.device, req_states, method: str) -> None:
        super().__init__(vllm_config, device)
        self.method = method
        self.req_states = req_states
        self.mask_token_id = int(vllm_config.model_config.hf_config.mask_token_id)
        self.num_forwards = 0  # forwards of the method's own (tests read it)

    # ------------------------------------------------------------ the runner's set-up calls

    def load_draft_model(self, target_model, target_attn_layer_names):  # the served model
        return target_model

    def load_model(self, target_model) -> None:
        """Called by the runner with the target model, the drafter: no draft layers, so no
        KV cache of its own."""
        self.model = target_model
        self.draft_attn_layer_names: set[str] = set()

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers,
                 target_attn_groups) -> None:
        """The runner's KV cache config, block tables and attention groups (the target's
        own: the drafts attend through the target's layers and cache)."""
        one_kv_cache_group(target_attn_groups, self.method)
        self.model_state = model_state
        self.kv_cache_config = kv_cache_config
        self.block_tables = block_tables
        self.target_input_buffers = target_input_buffers
        self.target_attn_groups = target_attn_groups
        self.attn_groups: list = []  # no draft layers: nothing for the runner to map

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """Nothing of its own to capture: the method's forwards run eagerly."""

    def capture(self) -> None:
        """Nothing to capture (eager forwards)."""

    # ------------------------------------------------------------ each step

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        """Draft tokens ``[num_reqs, num_speculative_tokens]`` for the runner's batch (its
        order), called after each verify's bookkeeping: every request's row starts as its
        last sampled token (the anchor), which the drafts :meth:`_fill_drafts` writes
        replace; the rest repeat it, and the verify may reject them like any draft."""
        num_reqs = input_batch.num_reqs
        drafts = self.draft_tokens[:num_reqs]  # [num_reqs, K]
        if dummy_run:  # warm-up / profile: no requests, nothing to draft
            drafts.zero_()
            return drafts
        idx = input_batch.idx_mapping[:num_reqs]  # [num_reqs] request-state rows
        anchors = last_sampled.view(-1)[idx]  # [num_reqs]
        drafts.copy_(anchors[:, None].expand(num_reqs, drafts.shape[1]))
        k = self.num_speculative_steps if num_speculative_tokens is None \
            else num_speculative_tokens
        self._fill_drafts(drafts, input_batch, anchors, num_sampled[:num_reqs].tolist(), k)
        return drafts

    def _fill_drafts(self, drafts: torch.Tensor, input_batch, anchors: torch.Tensor,
                     num_sampled: list[int], k: int) -> None:
        """Write this step's drafts into ``drafts`` ``[num_reqs, K]`` (rows hold the
        anchors): ``num_sampled`` tokens sampled per request, at most ``k`` drafts each."""
        raise NotImplementedError

    def _num_slots(self, input_batch) -> np.ndarray:
        """``[num_reqs]`` the KV slots each request of the batch holds (its blocks)."""
        rows = input_batch.idx_mapping_np[:input_batch.num_reqs]
        return self.block_tables.num_blocks.np[0, rows] * self.block_tables.block_sizes[0]
