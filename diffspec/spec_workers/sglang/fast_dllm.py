"""Fast-dLLM in SGLang's dLLM mode: ``--dllm-algorithm FastDLLM`` (a ``DllmAlgorithm``).

Design notes: docs/design/sglang.md (section ``diffspec/spec_workers/sglang/fast_dllm.py``).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from diffspec.core.unmask import sub_block_start, unmask_block
from diffspec.spec_workers.sglang.requests import (
    FAST_DLLM,
    fast_dllm_request_error,
    logprobs_error,
)

__all__ = ["FastDLLM", "RowState", "batch_requests", "request_stop_ids"]

_MAX_SEEDS = 1 << 16  # next-block seeds kept, by token prefix (oldest dropped first)


@dataclass
class RowState:
    """One request's view of its current block (made at the block's first forward)."""

    gen: int  # first generated slot of the block (slots before it are prompt)
    limit: int  # slots from here are past max_new_tokens: never decoded
    ends_here: bool  # the request's max_new_tokens end inside this block
    stops: torch.Tensor  # [num_stop_ids] int64; empty under ignore_eos
    seeded: bool = False  # the block-first slot was given its seed (shifted families)
    done: bool = False
    window: int | None = None  # dual cache: first slot of the sub-block last refreshed for


class FastDLLM(DllmAlgorithm):
    """Fast-dLLM prefix-cache decoding; settings from ``algorithm_config`` (resolved and
    validated by :func:`diffspec.plugin.sglang.dllm.dllm_config`)."""

    def __init__(self, config: DllmConfig) -> None:
        super().__init__(config)
        cfg = config.algorithm_config
        self.threshold = float(cfg["threshold"])
        self.sub_block_size = int(cfg["sub_block_size"])
        self.logits_shift = bool(cfg["logits_shift"])
        self.turn_end_ids = frozenset(int(t) for t in cfg.get("turn_end_ids", ()))
        self.dual = cfg.get("cache", "prefix") == "dual"
        self._seeds: OrderedDict[int, int] = OrderedDict()  # hash(token prefix) -> seed
        self._windows: list[int | None] = []  # dual cache: the next forward's query per row

    # ------------------------------------------------------------------ SGLang hooks

    @classmethod
    def validate_request(cls, req: Any) -> str | None:
        """Refuse a request whose sampling FastDLLM would ignore, or that asks for logprobs
        (SGLang aborts it alone)."""
        return fast_dllm_request_error(req.sampling_params) or logprobs_error(
            req, f"--dllm-algorithm {FAST_DLLM} unmasks several tokens a step by confidence")

    def max_steps(self, block_size: int) -> int:
        """Forwards after a block's first one (synchronous mode): one token per step, then
        the completing forward, with one to spare."""
        return block_size + 2

    def init_step_state(self, forward_batch: ForwardBatch) -> list[RowState]:
        reqs = batch_requests(forward_batch)
        offsets = forward_batch.positions.view(-1, self.block_size)[:, 0].tolist()
        states = []
        for req, offset in zip(reqs, offsets):
            if self.turn_end_ids and not self.turn_end_ids <= set(req.eos_token_ids or ()):
                # an instruct answer ends at the chat template's turn end: SGLang's own
                # finish check (Req.eos_token_ids) stops there too
                req.eos_token_ids = set(req.eos_token_ids or ()) | self.turn_end_ids
            gen0 = len(req.origin_input_ids)
            limit = gen0 + int(req.sampling_params.max_new_tokens)
            states.append(RowState(
                gen=min(self.block_size, max(0, gen0 - offset)),
                limit=min(self.block_size, max(0, limit - offset)),
                ends_here=limit - offset <= self.block_size,
                stops=torch.tensor(sorted(request_stop_ids(req)), dtype=torch.long,
                                   device=forward_batch.input_ids.device)))
        return states

    def prepare_inputs(self, model_runner, forward_batch: ForwardBatch,
                       states: list[RowState]) -> None:
        """Shifted families: write each block's seed (the completing forward's argmax)
        into its first slot before the block's first forward. Dual cache: choose each
        row's query for the coming forward (:meth:`_plan_windows`)."""
        self._seed_blocks(forward_batch, states)
        if self.dual:
            self._plan_windows(forward_batch, states)

    def _seed_blocks(self, forward_batch: ForwardBatch, states: list[RowState]) -> None:
        if not self.logits_shift or all(s.seeded for s in states):
            return
        tokens = forward_batch.input_ids.view(-1, self.block_size)
        offsets = forward_batch.positions.view(-1, self.block_size)[:, 0].tolist()
        for row, (req, state) in enumerate(zip(batch_requests(forward_batch), states)):
            if state.seeded:
                continue
            state.seeded = True
            if int(tokens[row, 0]) != self.mask_id or state.gen > 0:
                continue  # the block starts with the prompt
            seed = self._seeds.get(_prefix_key(_committed(req)[: offsets[row]]))
            if seed is not None:
                tokens[row, 0] = seed

    def run(self, model_runner, forward_batch: ForwardBatch, algo_states=None):
        self._windows = []
        runner = _DualCacheRunner(model_runner, self) if self.dual else model_runner
        out = super().run(runner, forward_batch, algo_states)
        if self.logits_shift and not self.fdfo and not out[1]:
            # a prefill of whole prompt blocks: the base class returns before any step
            logits = out[0].full_logits.view(forward_batch.batch_size, self.block_size, -1)
            for row in range(forward_batch.batch_size):
                self._record_seed(forward_batch, logits, row)
        return out

    def step(self, forward_batch: ForwardBatch, full_logits: torch.Tensor,
             states: list[RowState]) -> list[bool]:
        bs, size = forward_batch.batch_size, self.block_size
        logits = full_logits.view(bs, size, -1)
        tokens = forward_batch.input_ids.view(bs, size)
        bounds = _bounds(states, tokens.device)  # [bs, 2]
        has_work = self._work(tokens, bounds).any(1).tolist()  # [bs]
        decode = []  # rows with slots to decode
        for row, state in enumerate(states):
            if state.done:
                continue
            if has_work[row]:
                decode.append(row)
                continue
            # this forward saw the block complete: its KV is final
            if not state.ends_here and not self._stopped(tokens[row], state):
                self._record_seed(forward_batch, logits, row)
            state.done = True
        if not decode:
            return [s.done for s in states]
        rows = torch.tensor(decode, device=tokens.device)
        tokens[rows] = unmask_block(logits[rows], tokens[rows], bounds[rows, 1], self.mask_id,
                                    self.threshold, sub_block=self.sub_block_size,
                                    shifted=self.logits_shift, start=bounds[rows, 0])[0]
        for row in decode:
            state = states[row]
            finished = self._stopped(tokens[row], state) or (
                state.ends_here and not bool((tokens[row, state.gen : state.limit]
                                              == self.mask_id).any()))
            # a finished block with masks left is never cached whole; a full one is
            # completed by one more forward (see the module docstring)
            state.done = finished and bool((tokens[row] == self.mask_id).any())
        return [s.done for s in states]

    # ------------------------------------------------------------------ dual cache

    def _plan_windows(self, forward_batch: ForwardBatch, states: list[RowState]) -> None:
        """Dual cache (Fast-dLLM v2's block cache, the reference's ``cache="dual"`` on the
        block-causal layout): per row, the coming forward's query is its current sub-block
        alone, over the KV the block's other slots got from the row's last full forward,
        unless the row needs that full forward (a *refresh*): its sub-block changed, or
        (shifted) the sub-block's first slot is still masked (it reads the slot before
        it), or the row has no work left (the completing forward writes the block's final
        KV). ``None``: the whole block."""
        tokens = forward_batch.input_ids.view(-1, self.block_size)
        work = self._work(tokens, _bounds(states, tokens.device))  # [bs, size]
        c0 = sub_block_start(work, self.sub_block_size)  # [bs]
        first_masked = tokens.gather(1, c0[:, None])[:, 0] == self.mask_id  # [bs]
        plan = torch.stack([work.any(1).long(), c0, first_masked.long()], 1).tolist()
        self._windows = []
        for state, (has_work, start, masked) in zip(states, plan):
            window = None
            if not state.done and has_work:
                if state.window == start and not (self.logits_shift and masked):
                    window = start
                state.window = start
            self._windows.append(window)

    def dual_forward(self, model_runner, forward_batch: ForwardBatch):
        """One forward of the planned queries. Rows on a window run only its
        ``sub_block_size`` slots: the request's ``req_to_token`` row is reordered for the
        forward so that the window is its tail (the block's other slots, before it, are
        read as cached prefix K/V; positions travel with the tokens and block attention is
        bidirectional, so the order of the keys changes nothing) and restored after. The
        returned logits are laid out as the whole block's (``[bs * block_size, vocab]``,
        zeros outside the windows: only a window's own slots are read)."""
        windows = self._windows or [None] * forward_batch.batch_size
        if all(w is None for w in windows):
            return model_runner.forward(forward_batch, pp_proxy_tensors=None)
        bs, size, sub = forward_batch.batch_size, self.block_size, self.sub_block_size
        fb = copy.copy(forward_batch)
        table = model_runner.req_to_token_pool.req_to_token
        pools = forward_batch.req_pool_indices.tolist()
        prefix = list(forward_batch.extend_prefix_lens_cpu)
        keep = torch.ones(bs, size, dtype=torch.bool, device=forward_batch.input_ids.device)
        saved = []
        for row, c0 in enumerate(windows):
            if c0 is None:
                continue
            keep[row] = False
            keep[row, c0 : c0 + sub] = True
            p = prefix[row]
            block = table[pools[row], p : p + size].clone()
            saved.append((pools[row], p, block))
            inside = torch.zeros(size, dtype=torch.bool, device=block.device)
            inside[c0 : c0 + sub] = True
            table[pools[row], p : p + size] = torch.cat([block[~inside], block[inside]])
        lens = [sub if w is not None else size for w in windows]
        ext = torch.tensor(lens, dtype=forward_batch.extend_seq_lens.dtype,
                           device=forward_batch.extend_seq_lens.device)
        flat = keep.view(-1)
        fb.input_ids = forward_batch.input_ids[flat]
        fb.positions = forward_batch.positions[flat]
        fb.out_cache_loc = forward_batch.out_cache_loc[flat]
        fb.extend_num_tokens = sum(lens)
        fb.extend_seq_lens = ext
        fb.extend_seq_lens_cpu = lens
        fb.extend_prefix_lens_cpu = [p + size - n for p, n in zip(prefix, lens)]
        fb.extend_prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, dtype=ext.dtype,
                                             device=ext.device)
        fb.extend_start_loc = torch.cumsum(ext, 0) - ext
        fb.extend_logprob_start_lens_cpu = lens
        try:
            out = model_runner.forward(fb, pp_proxy_tensors=None)
        finally:
            for pool, p, block in saved:
                table[pool, p : p + size] = block
        logits = out.logits_output.full_logits
        full = logits.new_zeros(bs * size, logits.shape[-1])
        full[flat] = logits
        out.logits_output = copy.copy(out.logits_output)
        out.logits_output.full_logits = full
        return out

    # ------------------------------------------------------------------ helpers

    def _work(self, tokens: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """[bs, size] bool: the masked slots each row still decodes, those in ``[gen,
        limit)`` (``bounds``: :func:`_bounds`)."""
        slots = torch.arange(self.block_size, device=tokens.device)
        return ((tokens == self.mask_id) & (slots[None] >= bounds[:, :1])
                & (slots[None] < bounds[:, 1:]))

    def _stopped(self, tokens: torch.Tensor, state: RowState) -> bool:
        """A stop token committed in the generated slots with nothing masked before it."""
        gen = tokens[state.gen : state.limit]  # [n]
        hits = torch.isin(gen, state.stops).nonzero()
        if hits.numel() == 0:
            return False
        return not bool((gen[: int(hits[0, 0])] == self.mask_id).any())

    def _record_seed(self, forward_batch: ForwardBatch, logits: torch.Tensor, row: int) -> None:
        """Shifted families: the next block's first token is the argmax of this complete
        block's last logit. It is kept by the block's token prefix, not by request: a
        later request whose prompt ends on that block boundary gets the prefix's KV from
        the radix cache and no forward over its last prompt block, yet needs the same
        seed."""
        if not self.logits_shift:
            return
        last = logits[row, -1].clone()
        last[self.mask_id] = float("-inf")
        offset = int(forward_batch.positions.view(-1, self.block_size)[row, 0])
        req = batch_requests(forward_batch)[row]
        block = forward_batch.input_ids.view(-1, self.block_size)[row].tolist()
        key = _prefix_key([*_committed(req)[:offset], *block])
        self._seeds[key] = int(last.argmax())
        self._seeds.move_to_end(key)
        if len(self._seeds) > _MAX_SEEDS:
            self._seeds.popitem(last=False)


def _bounds(states: list[RowState], device: torch.device) -> torch.Tensor:  # [bs, 2] int64
    """Each row's ``(gen, limit)``: its generated slots before ``max_new_tokens``."""
    return torch.tensor([(s.gen, s.limit) for s in states], dtype=torch.long, device=device)


class _DualCacheRunner:
    """The model runner as :class:`FastDLLM`'s steps see it under the dual cache: its
    ``forward`` runs the queries :meth:`FastDLLM.prepare_inputs` planned."""

    def __init__(self, runner: Any, algorithm: FastDLLM) -> None:
        self._runner, self._algorithm = runner, algorithm

    def forward(self, forward_batch: ForwardBatch, pp_proxy_tensors=None):
        return self._algorithm.dual_forward(self._runner, forward_batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def batch_requests(forward_batch: ForwardBatch) -> list[Any]:
    """The scheduler's ``Req`` objects of this batch, in row order (shared by the FastDLLM
    and ReFusion algorithms: ``DllmAlgorithm.run`` receives the ``ForwardBatch`` only)."""
    orchestrator = getattr(forward_batch.sampling_info, "penalizer_orchestrator", None)
    batch = orchestrator.batch if orchestrator is not None else None
    reqs = list(batch.reqs) if batch is not None else []
    if [r.rid for r in reqs] != list(forward_batch.rids or []):
        raise RuntimeError("use SGLang 0.5.23: diffspec's dLLM algorithms (FastDLLM, ReFusion) "
                           "cannot see this batch's requests (their max_new_tokens and stop "
                           "tokens) through its sampling info in this SGLang version")
    return reqs


def _committed(req: Any) -> list[int]:
    """The request's committed tokens: prompt, then the outputs of its finished blocks."""
    return [*req.origin_input_ids, *req.output_ids]


def _prefix_key(tokens: list[int]) -> int:
    return hash(tuple(tokens))


def request_stop_ids(req: Any) -> set[int]:
    """The token ids SGLang finishes ``req`` on (``Req._check_token_based_finish``)."""
    params = req.sampling_params
    if params.ignore_eos:
        return set()
    ids = set(params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    tokenizer = req.tokenizer
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return ids
