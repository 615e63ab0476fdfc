"""vLLM drafter for TiDAR and NLD quadratic self-speculation: draft and verify in **one
forward per step**, on the target model's own layers, paged KV cache and attention backend.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/tidar.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import islice

import numpy as np
import torch
from torch import nn

from diffspec.core.adaptive import StepCost
from diffspec.profiling import DraftTimings
from diffspec.spec_workers.vllm.forward import decoder_forward
from diffspec.spec_workers.vllm.proposer import (
    NonCausalBlocks,
    adaptive_policy,
    draft_argmax,
    logger,
    measure_profile,
    non_causal_blocks,
    on_device,
    seeded_requests,
)
from diffspec.spec_workers.vllm.split_attention import SplitAttention, swap_attention

__all__ = ["BranchPlan", "TiDARProposer", "build_branches", "check_branch_budget",
           "check_decoder_layers", "next_draft_count", "plan_branches"]


@dataclass(frozen=True)
class BranchPlan:
    """One request's branches this step: ``num_drafts + 1`` branches of ``num_masks``."""

    row: int  # the request's row in the runner's input batch
    anchor: int  # position P of t_0, the first token of this step's verify chain
    num_drafts: int  # n: drafts verified this step
    num_masks: int  # K: mask tokens per branch


def plan_branches(
    num_scheduled: list[int],  # [num_reqs] tokens the runner forwards per request
    num_spec: list[int],  # [num_reqs] of those, drafts being verified
    num_computed: list[int],  # [num_reqs] tokens whose K/V are cached before this step
    num_tokens: list[int],  # [num_reqs] prompt + output tokens (no drafts)
    num_left: list[int | None],  # [num_reqs] max_tokens - output tokens (None: no limit)
    num_slots: list[int],  # [num_reqs] KV slots allocated to the request
    max_drafts: int,
    logits_shift: bool,
    max_model_len: int,
) -> list[BranchPlan]:
    """The branches to pre-draft this step: for every request that samples a token (a
    decode, or a prefill's last chunk) and may still take a draft after it."""
    skip = 0 if logits_shift else 1
    plans = []
    for row, q in enumerate(num_scheduled):
        n = num_spec[row]
        if q == 0 or num_computed[row] + q - n < num_tokens[row]:
            continue  # not scheduled, or a prefill chunk that samples nothing
        if num_left[row] is not None and num_left[row] < 3:
            continue  # this step emits >= 1 token; no room for the next draft after it
        anchor = num_computed[row] + q - 1 - n
        k = min(max_drafts + skip, max_model_len - 1 - (anchor + n),
                num_slots[row] - 1 - (anchor + n))
        if k - skip >= 1:
            plans.append(BranchPlan(row, anchor, n, k))
    return plans


def check_branch_budget(vllm_config, num_drafts: int, logits_shift: bool) -> int:
    """At the drafter's start: check that vLLM's scheduler reserves each request's branch
    rows in the step's token budget (patch ``drafting_rows``), so a step's forward never
    has more rows than vLLM's memory profile forwarded (``max_num_batched_tokens``), and
    that the budget holds one request's full step; log how many requests a step can then
    carry when that is fewer than ``max_num_seqs``. Returns the rows reserved per request."""
    from diffspec.plugin.vllm.config import budget_error, tidar_branch_rows

    rows = tidar_branch_rows(num_drafts, logits_shift)
    spec = vllm_config.speculative_config
    if getattr(spec, "max_num_new_slots_for_drafting", None) != rows:
        raise RuntimeError(
            "load the diffspec vLLM plugin on a vLLM release it lists (patch drafting_rows "
            "is not applied): method 'tidar' forwards its branch rows besides the scheduled "
            "tokens, and without the patch vLLM's scheduler does not reserve them in the "
            "token budget its memory profile was sized for")
    scheduler = vllm_config.scheduler_config
    budget = scheduler.max_num_batched_tokens
    error = budget_error(budget, num_drafts, logits_shift)
    if error:
        raise ValueError(error)
    per_request = num_drafts + 1 + rows
    if scheduler.max_num_seqs * per_request > budget:
        logger.info("diffspec: method 'tidar' reserves %d branch rows per scheduled request "
                    "in the step's token budget (max_num_batched_tokens %d, the rows vLLM's "
                    "memory profile forwarded): at most %d requests run a full step together "
                    "(max_num_seqs %d); raise max_num_batched_tokens to run more", rows,
                    budget, budget // per_request, scheduler.max_num_seqs)
    return rows


def next_draft_count(plan: BranchPlan, committed: int, num_left: int | None, num_slots: int,
                     max_drafts: int, logits_shift: bool, max_model_len: int) -> int:
    """Drafts to propose from ``plan``'s accepted branch, once ``committed`` tokens (prompt
    + output) are committed: never past ``max_tokens``, the context or the request's slots."""
    n = min(max_drafts, plan.num_masks - (0 if logits_shift else 1),
            max_model_len - committed, num_slots - committed)
    if num_left is not None:
        n = min(n, num_left - 1)
    return max(n, 0)


@dataclass
class _Branches:
    """This step's branch tokens, laid out branch index by branch index (``a`` = 0, 1 ..;
    within one ``a``, request by request), and the attention metadata of each index."""

    plans: list[BranchPlan]
    input_ids: torch.Tensor  # [B] mask token ids
    positions: torch.Tensor  # [B]
    steps: list[tuple[slice, NonCausalBlocks]]  # per branch index a, descending
    offsets: dict[tuple[int, int], int]  # (row, a) -> first branch token of that branch
    restore_index: torch.Tensor | None  # [R] verify tokens d_1 .. d_n (runner's layout)


def build_branches(
    plans: list[BranchPlan],
    blocks: Callable[[list[int], list[int], np.ndarray], NonCausalBlocks],
    query_start: np.ndarray,  # [num_reqs + 1] the runner's query start of each row
    mask_token_id: int,
    device: torch.device,
) -> _Branches:
    """The branch tokens of ``plans``, branch index by branch index; each index's
    non-causal metadata is ``blocks(rows, starts, lengths)`` (the runner rows with a branch
    there, its first position and mask count per row), built on the target's builders."""
    pos, steps, offsets = [], [], {}
    total = 0
    for a in range(max(p.num_drafts for p in plans) + 1):
        group = [p for p in plans if p.num_drafts >= a]
        built = blocks([p.row for p in group], [p.anchor + a + 1 for p in group],
                       np.array([p.num_masks for p in group], dtype=np.int32))
        for p, start in zip(group, built.query_start[:-1]):
            offsets[(p.row, a)] = total + int(start)
        steps.append((slice(total, total + built.num_tokens), built))
        pos.append(built.positions)
        total += built.num_tokens
    restore = np.concatenate([np.arange(query_start[p.row + 1] - p.num_drafts,
                                        query_start[p.row + 1]) for p in plans])
    return _Branches(
        plans=plans,
        input_ids=torch.full((total,), mask_token_id, dtype=torch.long, device=device),
        positions=torch.cat(pos),
        steps=steps[::-1],
        offsets=offsets,
        restore_index=(torch.from_numpy(restore.astype(np.int64)).to(device, non_blocking=True)
                       if len(restore) else None),
    )


class TiDARProposer:
    """The drafter vLLM's ``custom_class`` hook instantiates for method ``tidar``: its
    :meth:`forward_with_runner` replaces the verify forward, its
    :meth:`propose_with_runner` reads the accepted branch."""

    method = "tidar"

    def __init__(self, vllm_config) -> None:
        hf_config = vllm_config.model_config.hf_config
        self.vllm_config = vllm_config
        self.num_speculative_tokens: int = vllm_config.speculative_config.num_speculative_tokens
        self.mask_token_id = int(hf_config.mask_token_id)
        self.logits_shift = getattr(hf_config, "dlm_type", None) == "dream"
        self.max_model_len: int = vllm_config.model_config.max_model_len
        check_branch_budget(vllm_config, self.num_speculative_tokens, self.logits_shift)
        self.num_forwards = 0  # forwards run by forward_with_runner (one per step)
        self._branches: _Branches | None = None
        self._branch_hidden: torch.Tensor | None = None  # [B, hidden]
        self.adaptive = adaptive_policy(
            vllm_config, self.num_speculative_tokens,
            StepCost("quadratic", skip=0 if self.logits_shift else 1))
        self._verified: list[int] = []  # [num_reqs] drafts each row verifies this step
        self._emitted: int | None = None  # tokens the last step emitted (all requests)
        self.timings = DraftTimings(vllm_config.device_config.device)
        self._step_timing: tuple[float | None, int] = (None, 0)  # (start, query tokens)

    def load_model(self, model) -> None:
        """Called by the runner with the target model: check it has the layers this
        drafter runs (a decoder-only model whose layers take ``(positions, hidden,
        residual)`` and hold ``self_attn.attn``)."""
        check_decoder_layers(model)

    def measure_latency_profile(self, runner) -> None:
        """Called once after the worker's warm-up (patch ``warm_up_profile``): the adaptive
        policy's latency profile, from the cache or timed on the runner's own forwards up
        to the widest step it can choose (every request verifying and pre-drafting the
        full block: ``(k + 1)(1 + k + skip)`` tokens each), at most the runner's budget."""
        k, skip = self.num_speculative_tokens, 0 if self.logits_shift else 1
        max_reqs = self.vllm_config.scheduler_config.max_num_seqs
        measure_profile(runner, self.adaptive, self.method, max_reqs * (k + 1) * (1 + k + skip))

    def propose(self, *args, **kwargs):
        raise RuntimeError("method 'tidar' drafts through diffspec's runner patches, which "
                           "are not applied: is the diffspec vLLM plugin loaded (VLLM_PLUGINS)?")

    # ---------------------------------------------------------------- the forward

    def forward_with_runner(self, runner, fallback: Callable[[], torch.Tensor], input_ids,
                            positions, intermediate_tensors=None, inputs_embeds=None,
                            **model_kwargs) -> torch.Tensor:
        """The step's one forward: the runner's tokens (returned hidden states, as the
        model's forward returns them) plus this step's branches (kept for
        :meth:`propose_with_runner`)."""
        self._branches = self._branch_hidden = None
        plans = self._plan(runner)
        if self.adaptive is not None:
            plans = self._adapt(runner, plans)
        if input_ids is None or intermediate_tensors is not None:
            plans = []
        skip = 0 if self.logits_shift else 1
        self.timings.step(runner.input_batch.req_ids, [p.num_drafts for p in plans],
                          [p.num_masks - skip for p in plans])
        if not plans:
            return fallback()
        from vllm.forward_context import get_forward_context

        if not isinstance(get_forward_context().attn_metadata, dict):
            raise NotImplementedError("method 'tidar' runs one attention metadata per layer; "
                               "micro-batching (--enable-dbo / ubatches) is not supported")
        self.num_forwards += 1
        num_verify = input_ids.shape[0]
        # timed from here to the end of propose_with_runner: the forward, vLLM's sampler
        # and the drafts (what a step adds to a plain AR step's forward and sampler)
        self._step_timing = (self.timings.start(),
                             num_verify + sum((p.num_drafts + 1) * p.num_masks for p in plans))
        hidden, branches = self._forward(runner, plans, input_ids, positions)
        self._branches, self._branch_hidden = branches, hidden[num_verify:]
        return hidden[:num_verify]

    def _forward(self, runner, plans: list[BranchPlan], input_ids: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, _Branches]:
        """The quadratic forward: hidden states ``[T + B, hidden]`` and the branches."""
        model = runner.get_model()
        num_verify = input_ids.shape[0]
        branches = build_branches(
            plans, lambda rows, starts, lengths: non_causal_blocks(
                runner, rows, starts, lengths, self.method),
            runner.query_start_loc.np, self.mask_token_id, runner.device)
        ids = torch.cat([input_ids, branches.input_ids])  # [T + B]
        pos = torch.cat([positions[:num_verify], branches.positions])  # [T + B]
        with _quadratic_attention(model, num_verify, branches):
            return decoder_forward(model.model, ids, pos), branches  # [T + B, hidden]

    def _adapt(self, runner, plans: list[BranchPlan]) -> list[BranchPlan]:
        """The policy's draft count for the step: every request that samples a token
        this step pre-drafts ``min(k, its cap)``; ``k = 0`` drops every branch (a plain AR
        step next, the runner's own forward). One count per step, not per request: once
        any request has branches the whole batch runs the quadratic forward, so a step
        where some requests draft costs what a drafting step costs, which a per-request
        price does not see (adaptive-synth-tidar-vllm, c = 16)."""
        batch = runner.input_batch
        req_ids = batch.req_ids
        # the step since the last forward ended; one with a prefill chunk in it (a request
        # forwarding more than its anchor and drafts) is not learned
        query = np.diff(runner.query_start_loc.np[:batch.num_reqs + 1])
        decoding = all(int(q) == 1 + len(batch.spec_token_ids[i]) for i, q in enumerate(query))
        self.adaptive.step_started(req_ids if decoding else (), self._emitted)
        self._emitted = None
        self._verified = [len(batch.spec_token_ids[i]) for i in range(batch.num_reqs)]
        self.adaptive.forget(set(req_ids))
        skip = 0 if self.logits_shift else 1
        caps = [p.num_masks - skip for p in plans]
        planned = [req_ids[p.row] for p in plans]
        k = self.adaptive.choose_shared(planned, caps, seeded_requests(runner, planned))
        counts = [min(k, cap) for cap in caps]
        if plans and self.adaptive.steps % self.adaptive.log_every == 1:
            logger.info("diffspec: %s", self.adaptive.summary())
        return [replace(p, num_masks=k + skip) for p, k in zip(plans, counts) if k > 0]

    def _plan(self, runner) -> list[BranchPlan]:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        query_start = runner.query_start_loc.np[:num_reqs + 1]
        table = batch.block_table[0]
        return plan_branches(
            np.diff(query_start).tolist(),
            [len(batch.spec_token_ids[i]) for i in range(num_reqs)],
            batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            batch.num_tokens_no_spec[:num_reqs].tolist(),
            _num_left(runner),
            (table.num_blocks_per_row[:num_reqs] * table.block_size).tolist(),
            self.num_speculative_tokens, self.logits_shift, self.max_model_len)

    # ---------------------------------------------------------------- the drafts

    @torch.inference_mode()
    def propose_with_runner(self, runner, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Draft token ids ``[num_reqs][k_i]``: the argmax of the branch each request's
        acceptance selected."""
        drafts = self._propose(runner, sampled_token_ids)
        start, tokens = self._step_timing
        self._step_timing = (None, 0)
        self.timings.stop(start, tokens, kind="verify")
        return drafts

    def _propose(self, runner, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        branches, hidden = self._branches, self._branch_hidden
        self._branches = self._branch_hidden = None
        if self.adaptive is not None:  # this step's verify outcomes
            self._emitted = sum(len(t) for t in sampled_token_ids)
            for n, emitted in zip(self._verified, sampled_token_ids):
                if n > 0 and emitted:
                    self.adaptive.estimate.update(n, min(len(emitted) - 1, n))
            self._verified = []
        if branches is None:
            return drafts
        batch = runner.input_batch
        table = batch.block_table[0]
        num_left = _num_left(runner)
        skip = 0 if self.logits_shift else 1
        rows, counts, index = [], [], []
        for plan in branches.plans:
            emitted = sampled_token_ids[plan.row]
            if not emitted:
                continue
            a = len(emitted) - 1  # drafts accepted: this branch pre-drafted the outcome
            count = next_draft_count(
                plan, int(batch.num_tokens_no_spec[plan.row]), num_left[plan.row],
                int(table.num_blocks_per_row[plan.row]) * table.block_size,
                self.num_speculative_tokens, self.logits_shift, self.max_model_len)
            if count > 0:
                start = branches.offsets[(plan.row, a)] + skip
                rows.append(plan.row)
                counts.append(count)
                index.extend(range(start, start + count))
        if not index:
            return drafts
        model = runner.get_model()
        tokens = draft_argmax(model, hidden,
                              on_device(runner, np.asarray(index, dtype=np.int64)))  # [sum k]
        if tokens is None:  # a TP rank that does not hold the gathered logits
            return drafts
        for row, end, count in zip(rows, np.cumsum(counts), counts):
            drafts[row] = tokens[end - count:end]
        return drafts


def check_decoder_layers(model: nn.Module) -> None:
    """Refuse a model whose layers the quadratic forward cannot run: it needs a
    decoder-only model whose layers take ``(positions, hidden, residual)`` and hold
    ``self_attn.attn``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_input_ids") or not all(
            hasattr(getattr(layer, "self_attn", None), "attn")
            for layer in islice(layers, inner.start_layer, inner.end_layer)):
        raise TypeError(f"method 'tidar' runs a decoder-only model whose layers hold "
                        f"self_attn.attn; {type(model).__name__} is not one (check "
                        f"config.json architectures)")


def _num_left(runner) -> list[int | None]:
    """``max_tokens`` minus the tokens emitted so far, per request row."""
    out = []
    for req_id in runner.input_batch.req_ids:
        state = runner.requests[req_id]
        max_tokens = getattr(state.sampling_params, "max_tokens", None)
        out.append(None if max_tokens is None else max_tokens - len(state.output_token_ids))
    return out


def _quadratic_attention(model: nn.Module, num_verify: int, branches: _Branches):
    """Swap every layer's ``Attention`` for a :class:`_QuadraticAttention` around it."""
    return swap_attention(model, lambda attn: _QuadraticAttention(attn, num_verify, branches))


class _QuadraticAttention(SplitAttention):
    """One layer's attention over the verify tokens then the branches (module docstring)."""

    def __init__(self, attn: nn.Module, num_verify: int, branches: _Branches) -> None:
        super().__init__(attn)
        self.num_verify = num_verify
        self.branches = branches

    def calls(self, slot_mapping: torch.Tensor) -> tuple[list, tuple | None]:
        name, t = self.attn.layer_name, self.num_verify
        calls = [(slice(0, t), None, None)]  # the runner's causal verify
        calls += [(slice(t + part.start, t + part.stop), blocks.attn_metadata[name],
                   blocks.slot_mapping) for part, blocks in self.branches.steps]  # a = n .. 0
        index = self.branches.restore_index  # the branches overwrote d_1 .. d_n: write back
        return calls, None if index is None else (index, slot_mapping[index])
