"""vLLM V2 model runner speculator for TiDAR and NLD quadratic self-speculation: the V1
one-forward step of :mod:`~diffspec.spec_workers.vllm.tidar` as a speculator of vLLM's V2
runner (``vllm/v1/worker/gpu/``), built by ``init_speculator`` (patch ``v2_speculator``).

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/tidar_v2.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from diffspec.spec_workers.vllm.forward import decoder_forward
from diffspec.spec_workers.vllm.proposer import (
    draft_argmax,
    non_causal_metadata,
    one_kv_cache_group,
)
from diffspec.spec_workers.vllm.speculator import SelfSpeculator
from diffspec.spec_workers.vllm.tidar import (
    BranchPlan,
    _Branches,
    _quadratic_attention,
    build_branches,
    check_branch_budget,
    check_decoder_layers,
    next_draft_count,
    plan_branches,
)

__all__ = ["TiDARSpeculator"]


class TiDARSpeculator(SelfSpeculator):
    """TiDAR on the V2 runner: the target forward of each step carries the branches.

    * ``set_attn`` wraps the runner's model state's ``prepare_attn`` (called right before the
      target forward, with the step's input batch and block tables): after vLLM's own
      metadata for the scheduled tokens, it plans the step's branches and builds their
      non-causal metadata on the target's builders;
    * ``load_model`` wraps the target model's ``forward`` (the call
      ``GPUModelRunner.execute_model`` makes eagerly; CUDA graphs are off for ``tidar`` on
      this runner): a step with branches runs the model's layers over the scheduled tokens
      and the branches (``tidar._QuadraticAttention``) and returns the scheduled tokens'
      hidden states only, which vLLM's sampler and rejection sampler verify;
    * ``propose`` (after sampling) drafts the next step from the branch each request's
      acceptance selected: the argmax of its rows.
    """

    def __init__(self, vllm_config, device: torch.device, req_states) -> None:
        # num_forwards counts the forwards that carried branches
        super().__init__(vllm_config, device, req_states, "tidar")
        hf_config = vllm_config.model_config.hf_config
        self.logits_shift = getattr(hf_config, "dlm_type", None) == "dream"
        check_branch_budget(vllm_config, self.num_speculative_steps, self.logits_shift)
        self._planned: _Branches | None = None  # built by prepare_attn, run by the forward
        self._ran: tuple[_Branches, torch.Tensor] | None = None  # branches, their hidden

    # ------------------------------------------------------------ the runner's set-up calls

    def load_model(self, target_model) -> None:
        """The target model: check its layers, and route its forward through
        :meth:`_forward`."""
        check_decoder_layers(target_model)
        super().load_model(target_model)
        original = target_model.forward

        def forward(input_ids=None, positions=None, intermediate_tensors=None,
                    inputs_embeds=None, **kwargs):
            return self._forward(original, input_ids, positions, intermediate_tensors,
                                 inputs_embeds, **kwargs)

        target_model.forward = forward  # the instance's: nn.Module.__call__ calls it

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers,
                 target_attn_groups) -> None:
        """The runner's block tables and attention groups (``SelfSpeculator.set_attn``),
        refused where the backend splits the KV blocks; wrap the model state's
        ``prepare_attn`` to plan each step's branches."""
        for group in one_kv_cache_group(target_attn_groups, "tidar"):
            if group.kernel_block_size is not None:
                # the mapped block tables live in one persistent buffer per group: the
                # branches' builds would overwrite the verify's before it runs
                # (refused at config time where the launch names the backend:
                # diffspec.plugin.vllm.config.tidar_kernel_split_error; this is the backstop)
                from diffspec.plugin.vllm.config import split_kernel_block_message

                raise RuntimeError(split_kernel_block_message(
                    group.kv_cache_spec.block_size, group.kernel_block_size,
                    group.backend.get_name()))
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers,
                         target_attn_groups)
        original = model_state.prepare_attn

        def prepare_attn(input_batch, cudagraph_mode, tables, *args, **kwargs):
            metadata = original(input_batch, cudagraph_mode, tables, *args, **kwargs)
            self._planned = None
            if "ubatch_idx" in kwargs:  # GPUModelRunner's own call passes none
                raise NotImplementedError("method 'tidar' runs one attention metadata per "
                                          "layer; micro-batching (--enable-dbo / ubatches) "
                                          "is not supported")
            self._planned = self._plan(input_batch, tables[0])
            return metadata

        model_state.prepare_attn = prepare_attn

    # ------------------------------------------------------------ each step

    def _plan(self, input_batch, tables: torch.Tensor) -> _Branches | None:
        """This step's branches: for every request that samples a token and may take a
        draft after it (``tidar.plan_branches``, the V1 drafter's rule)."""
        known = self.req_states.req_id_to_index
        num_reqs = input_batch.num_reqs
        if num_reqs == 0 or not all(r in known for r in input_batch.req_ids):
            return None  # a dummy batch (warm-up, profile)
        scheduled = input_batch.num_scheduled_tokens[:num_reqs].astype(np.int64)
        drafts = input_batch.num_draft_tokens_per_req
        drafts = (np.zeros(num_reqs, dtype=np.int64) if drafts is None
                  else drafts[:num_reqs].astype(np.int64))
        computed = input_batch.num_computed_tokens_np[:num_reqs].astype(np.int64)
        # prompt + output tokens: a prefill chunk short of the prompt samples nothing
        num_tokens = np.maximum(input_batch.prefill_len_np[:num_reqs],
                                computed + scheduled - drafts)
        slots = self._num_slots(input_batch)
        plans = plan_branches(scheduled.tolist(), drafts.tolist(), computed.tolist(),
                              num_tokens.tolist(), [None] * num_reqs, slots.tolist(),
                              self.num_speculative_steps, self.logits_shift,
                              self.max_model_len)
        if not plans:
            return None
        return self._build_branches(plans, tables, input_batch.query_start_loc_np)

    def _build_branches(self, plans: list[BranchPlan], tables: torch.Tensor,
                        query_start: np.ndarray) -> _Branches:
        """The branches (``tidar.build_branches``), each index's metadata built now on the
        target's builders (``proposer.non_causal_metadata``)."""
        page = self.block_tables.block_sizes[0]

        def blocks(rows: list[int], starts: list[int], lengths: np.ndarray):
            rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            return non_causal_metadata(self.target_attn_groups[0], tables[rows], page,
                                       starts, lengths, self.method, self.device)

        return build_branches(plans, blocks, query_start, self.mask_token_id, self.device)

    def _forward(self, original, input_ids, positions, intermediate_tensors, inputs_embeds,
                 **kwargs) -> torch.Tensor:
        """The target forward: vLLM's when the step has no branches, else the scheduled
        tokens and the branches in one forward (hidden states of the scheduled tokens)."""
        branches, self._planned = self._planned, None
        self._ran = None
        if branches is None or input_ids is None or inputs_embeds is not None \
                or intermediate_tensors is not None:  # no drafts next step: still lossless
            return original(input_ids=input_ids, positions=positions,
                            intermediate_tensors=intermediate_tensors,
                            inputs_embeds=inputs_embeds, **kwargs)
        from vllm.forward_context import get_forward_context

        if not isinstance(get_forward_context().attn_metadata, dict):
            raise NotImplementedError("method 'tidar' runs one attention metadata per layer; "
                                      "micro-batching (--enable-dbo / ubatches) is not "
                                      "supported")
        num_verify = input_ids.shape[0]
        ids = torch.cat([input_ids, branches.input_ids])  # [T + B]
        pos = torch.cat([positions[:num_verify], branches.positions])  # [T + B]
        with _quadratic_attention(self.model, num_verify, branches):
            hidden = decoder_forward(self.model.model, ids, pos)  # [T + B, hidden]
        self.num_forwards += 1
        self._ran = (branches, hidden[num_verify:])
        return hidden[:num_verify]

    def _fill_drafts(self, drafts: torch.Tensor, input_batch, anchors: torch.Tensor,
                     num_sampled: list[int], k: int) -> None:
        """The argmax of the branch each request's acceptance selected (as many drafts as
        ``next_draft_count`` gives); past that branch (or with none) its row keeps the
        anchor."""
        ran, self._ran = self._ran, None
        if self._planned is not None:
            self._planned = None
            raise RuntimeError("method 'tidar' planned branches that no forward ran (the "
                               "runner replayed a CUDA graph?): set cudagraph_mode NONE or "
                               "add --enforce-eager")
        if ran is None:
            return
        branches, hidden = ran
        slots = self._num_slots(input_batch).tolist()
        skip = 0 if self.logits_shift else 1
        rows, counts, index = [], [], []
        for plan in branches.plans:
            n = num_sampled[plan.row]
            if n == 0:
                continue
            # n - 1 drafts accepted: that branch pre-drafted this outcome; the committed
            # tokens end with the sampled one at position anchor + n
            count = next_draft_count(plan, plan.anchor + n + 1, None, slots[plan.row],
                                     self.num_speculative_steps, self.logits_shift,
                                     self.max_model_len)
            if count > 0:
                start = branches.offsets[(plan.row, n - 1)] + skip
                rows.append(plan.row)
                counts.append(count)
                index.extend(range(start, start + count))
        if not index:
            return
        tokens = draft_argmax(self.model, hidden,
                              torch.tensor(index, dtype=torch.int64, device=self.device))
        if tokens is None:  # a tensor-parallel rank without the gathered logits
            return
        at = 0
        for row, count in zip(rows, counts):
            drafts[row, :count] = torch.tensor(tokens[at:at + count], dtype=drafts.dtype)
            at += count
