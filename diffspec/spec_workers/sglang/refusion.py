"""ReFusion in SGLang's dLLM mode: ``--dllm-algorithm ReFusion`` (a ``DllmAlgorithm``).

Design notes: docs/design/sglang.md (section ``diffspec/spec_workers/sglang/refusion.py``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from diffspec.core.slots import (
    committed_slot_lengths,
    first_stop_in_slots,
    score_slots,
    select_slots,
    verify_slot_drafts,
)
from diffspec.spec_workers.sglang.fast_dllm import batch_requests, request_stop_ids
from diffspec.spec_workers.sglang.requests import refusion_request_error

__all__ = ["ReFusion"]


@dataclass
class _Rows:
    """One request's share of an engine forward: row r runs ``input_ids[r]`` at
    ``positions[r]`` as a causal extend of ``req_to_token`` row ``pools[r]`` after its first
    ``prefix`` KV entries."""

    pools: list[int]
    prefix: int
    input_ids: torch.Tensor  # [rows, n]
    positions: torch.Tensor  # [rows, n]


# A request's decoder: yields the rows of its next forward (None: waiting for scratch rows
# of the request pool) and is sent their fp32 logits [rows, n, vocab] (None after a wait).
_Decoder = Generator["_Rows | None", "torch.Tensor | None", None]


@dataclass
class _Block:
    """One request's serial block: committed slots are in the KV slots ``locs[:committed]``."""

    req: Any  # the scheduler's Req
    pool: int  # the request's req_to_token row
    prompt_len: int  # KV entries before the block (the prompt, causally encoded)
    first_position: int  # position of slot 0's first token
    locs: torch.Tensor  # [block_size] the block's KV slots (req_to_token[pool, prompt_len:])
    stops: tuple[int, ...]
    masked: list[int] = field(default_factory=list)  # still-masked slots, original order
    slot_tokens: dict[int, list[int]] = field(default_factory=dict)
    committed: int = 0  # KV entries of the block holding committed tokens
    stopped: bool = False  # a stop token was committed: no later serial block

    def rows(self, pools: list[int], start: int, input_ids: torch.Tensor,
             positions: torch.Tensor) -> _Rows:
        """Rows over the committed KV plus ``start`` entries of each row's own slot."""
        return _Rows(pools, self.prompt_len + self.committed + start, input_ids, positions)


class ReFusion(DllmAlgorithm):
    """ReFusion plan-and-infill; settings from ``algorithm_config`` (resolved and validated
    by :func:`diffspec.plugin.sglang.refusion.refusion_dllm_config`)."""

    requires_separate_context_encoding = True
    supported_architectures = ("Qwen3ForCausalLM",)

    def __init__(self, config: DllmConfig) -> None:
        super().__init__(config)
        cfg = config.algorithm_config
        self.slot_size = int(cfg["slot_size"])
        self.slot_threshold = float(cfg["slot_threshold"])
        self.token_threshold = float(cfg["token_threshold"])
        self.num_blocks = int(cfg["num_blocks"])
        self.vocab_size = int(cfg["vocab_size"])
        self._last_output = None  # the logits output of the latest forward (to the scheduler)

    @classmethod
    def validate_request(cls, req) -> str | None:
        cfg = req.dllm_config
        return refusion_request_error(req, cfg.block_size, int(cfg.algorithm_config["slot_size"]),
                                   int(cfg.algorithm_config["num_blocks"]))

    def run(self, model_runner, forward_batch: ForwardBatch, algo_states=None):
        if not forward_batch.forward_mode.is_dllm_extend():  # the prompt's causal prefill
            out = model_runner.forward(forward_batch)
            return out.logits_output, [], None, None, out.can_run_graph
        # the stock Qwen3 returns the last logit; ReFusion reads every position's
        model_runner.model.logits_processor.return_full_logits = True
        req_to_token = model_runner.req_to_token_pool.req_to_token
        blocks = []
        for row, req in enumerate(batch_requests(forward_batch)):
            pool = int(forward_batch.req_pool_indices[row])
            prompt_len = int(forward_batch.extend_prefix_lens_cpu[row])
            first = int(forward_batch.positions[row * self.block_size])
            assert first == prompt_len, "ReFusion's block starts right after the prompt KV"
            locs = req_to_token[pool, prompt_len : prompt_len + self.block_size].clone()
            blocks.append(_Block(req, pool, prompt_len, first, locs,
                                 tuple(sorted(request_stop_ids(req)))))
        decoders = [self._decode(model_runner, b) for b in blocks]
        try:
            self._drive(model_runner, forward_batch, decoders)
        finally:  # a decoder stopped mid-completion gives its scratch rows back
            for decoder in decoders:
                decoder.close()
        return self._last_output, [self._finish(b) for b in blocks], None, None, False

    def _drive(self, runner, template: ForwardBatch, decoders: list[_Decoder]) -> None:
        """Step every request's decoder until all are done: one engine forward per step
        over the rows of each request that has a forward to run."""
        # each request's next forward; None: not started yet, or waiting for free pool rows
        wants: dict[int, _Rows | None] = dict.fromkeys(range(len(decoders)))

        def advance(i: int, value: torch.Tensor | None) -> None:
            try:
                wants[i] = decoders[i].send(value)
            except StopIteration:
                del wants[i]

        while wants:
            for i in [i for i, w in wants.items() if w is None]:
                advance(i, None)
            ready = [i for i, w in wants.items() if w is not None]
            if wants and not ready:
                raise RuntimeError(
                    "raise --max-running-requests: ReFusion's parallel completion found too "
                    f"few free rows of SGLang's request pool "
                    f"({runner.req_to_token_pool.available_size()} free) for any request")
            if ready:
                logits = self._forward(runner, template, [wants[i] for i in ready])
                for i, out in zip(ready, logits):
                    advance(i, out)

    # ------------------------------------------------------------------ one request

    def _decode(self, runner, b: _Block) -> _Decoder:
        """The request's serial blocks, round after round (the reference's loop)."""
        num_slots = math.ceil(b.req.sampling_params.max_new_tokens / self.slot_size)
        per_block = num_slots // self.num_blocks  # validate_request: it splits
        for serial in range(self.num_blocks):  # over the KV of the serial blocks before
            b.masked = list(range(serial * per_block, (serial + 1) * per_block))
            while b.masked:
                yield from self._round(runner, b)
            if b.stopped:
                break

    def _round(self, runner, b: _Block) -> _Decoder:
        """Plan, global verify, parallel completion: commits at least one slot."""
        S, device = self.slot_size, b.locs.device

        # plan: the still-masked slots (original order, true positions) over the committed KV
        masked = torch.tensor(b.masked, device=device)  # [m]
        positions = b.first_position + masked[:, None] * S + torch.arange(S, device=device)
        logits = yield b.rows([b.pool], 0, torch.full_like(positions, self.mask_id).view(1, -1),
                              positions.view(1, -1))
        logits = logits.view(len(masked), S, -1)  # [m, S, V]
        scores, _ = score_slots(logits[:, 0])
        chosen = select_slots(scores, self.slot_threshold).nonzero().flatten()
        slots, positions = masked[chosen], positions[chosen]  # [k], [k, S]
        drafts = logits[chosen].argmax(dim=-1)  # [k, S]

        # global verify: the drafts one after another, causally, writing their KV in place
        logits = yield b.rows([b.pool], 0, drafts.view(1, -1), positions.view(1, -1))
        accepted = self._accept(drafts, logits.view(len(slots), S, -1), 0)
        stop_at = first_stop_in_slots(drafts, accepted, b.stops)  # [k]
        keep, stopped = committed_slot_lengths(accepted, stop_at, S)
        if keep:
            lead = len(keep)
            self._commit(b, slots[:lead], drafts[:lead], keep, stopped)
            return

        # parallel completion: one row per chosen slot, each over the committed KV only
        tokens, rows = drafts.clone(), len(slots)
        keep, stopped = [S] * rows, False
        while (pools := self._row_pools(runner, b, rows)) is None:
            yield None  # other requests' completions hold the free pool rows
        try:
            start = 0
            while int(accepted.min()) < S:
                open_ = torch.arange(S, device=device)[None] >= accepted[:, None]  # [rows, S]
                draft_in = torch.where(open_, self.mask_id, tokens)[:, start:]
                proposed = (yield b.rows(pools[:rows], start, draft_in,
                                         positions[:, start:])).argmax(-1)
                tokens[:, start:] = torch.where(open_[:, start:], proposed, tokens[:, start:])
                logits = yield b.rows(pools[:rows], start, tokens[:, start:],
                                      positions[:, start:])
                accepted = self._accept(tokens, logits, start, accepted)
                stop_at = first_stop_in_slots(tokens, accepted, b.stops)
                if bool((stop_at >= 0).any()):  # rows after the first stop are dropped
                    stopped, rows = True, int((stop_at >= 0).nonzero()[0]) + 1
                    tokens, positions, accepted = tokens[:rows], positions[:rows], accepted[:rows]
                    keep = [S] * (rows - 1) + [int(stop_at[rows - 1]) + 1]
                    accepted[-1] = S
                    slots = slots[:rows]
                start = int(accepted.min())
        finally:
            runner.req_to_token_pool.free_rows(pools[1:])
        self._commit(b, slots, tokens, keep, stopped)

    def _accept(self, tokens: torch.Tensor, logits: torch.Tensor, start: int,
                accepted: torch.Tensor | None = None) -> torch.Tensor:  # [rows]
        """Token-threshold acceptance of ``tokens`` [rows, S] from the causal logits of
        the window ``[start:]`` ([rows, S - start, V]), as the reference's ``_verify``."""
        probs = torch.ones(tokens.shape, dtype=logits.dtype, device=tokens.device)
        window = tokens[:, start + 1 :]
        probs[:, start + 1 :] = torch.softmax(logits[:, :-1], -1).gather(
            -1, window[..., None])[..., 0]
        return verify_slot_drafts(tokens, probs, self.token_threshold, accepted)

    def _commit(self, b: _Block, slots: torch.Tensor, tokens: torch.Tensor, keep: list[int],
                stopped: bool) -> None:
        """Committed slots' KV is already in place, in this order: move the length."""
        for slot, row, k in zip(slots.tolist(), tokens.tolist(), keep):
            b.slot_tokens[slot] = row[:k]
            b.masked.remove(slot)
            b.committed += k
        if stopped:  # nothing after the stop slot will be generated
            b.stopped = True
            last = int(slots[-1])
            b.masked = [s for s in b.masked if s < last]

    def _finish(self, b: _Block) -> torch.Tensor:
        """The slots in original order, cut after the first stop and at max_new_tokens."""
        tokens: list[int] = []
        slot = 0
        while slot in b.slot_tokens:  # only slots after a stop are never generated
            tokens += b.slot_tokens[slot]
            slot += 1
        for i, t in enumerate(tokens):
            if t in b.stops:
                tokens = tokens[: i + 1]
                break
        tokens = tokens[: b.req.sampling_params.max_new_tokens]
        return torch.tensor(tokens, dtype=torch.long)

    # ------------------------------------------------------------------ engine plumbing

    def _row_pools(self, runner, b: _Block, rows: int) -> list[int] | None:
        """``req_to_token`` rows for the completion: the request's own, then scratch rows
        holding its prefix entries and slot ``r``'s KV slots behind the committed ones;
        ``None`` while the pool has too few free rows."""
        S, table = self.slot_size, runner.req_to_token_pool.req_to_token
        scratch = runner.req_to_token_pool.alloc_rows(rows - 1)
        if scratch is None:
            return None
        prefix = b.prompt_len + b.committed
        for r, pool in enumerate(scratch, start=1):
            at = b.committed + r * S  # slot r's KV slots in the block
            table[pool, :prefix] = table[b.pool, :prefix]
            table[pool, prefix : prefix + S] = b.locs[at : at + S]
        return [b.pool, *scratch]

    def _forward(self, runner, template: ForwardBatch, parts: list[_Rows]
                 ) -> list[torch.Tensor]:
        """One causal ``DLLM_EXTEND`` forward over the rows of every part, ragged (the
        rows' tokens concatenated, each row with its own prefix and query length). Returns
        each part's fp32 logits [rows, n, vocab]."""
        table = runner.req_to_token_pool.req_to_token
        device = template.seq_lens.device
        pools = [pool for p in parts for pool in p.pools]
        prefix_cpu = [p.prefix for p in parts for _ in p.pools]
        ext_cpu = [p.input_ids.shape[1] for p in parts for _ in p.pools]
        pool_ids = torch.tensor(pools, dtype=template.req_pool_indices.dtype,
                                device=template.req_pool_indices.device)
        ext = torch.tensor(ext_cpu, dtype=template.extend_seq_lens.dtype, device=device)
        prefix = torch.tensor(prefix_cpu, dtype=template.extend_seq_lens.dtype, device=device)
        seq_lens = (prefix + ext).to(template.seq_lens.dtype)
        out_cache_loc = [table[p.pools, p.prefix : p.prefix + p.input_ids.shape[1]].reshape(-1)
                         for p in parts]
        fb = copy.copy(template)
        fb.forward_mode = ForwardMode.DLLM_EXTEND
        fb.batch_size = len(pools)
        fb.input_ids = torch.cat([p.input_ids.reshape(-1) for p in parts]).to(
            template.input_ids.dtype)
        fb.positions = torch.cat([p.positions.reshape(-1) for p in parts]).to(
            template.positions.dtype)
        fb.req_pool_indices = pool_ids
        fb.req_pool_indices_cpu = pool_ids.cpu()
        fb.out_cache_loc = torch.cat(out_cache_loc).to(template.out_cache_loc.dtype)
        fb.seq_lens, fb.orig_seq_lens = seq_lens, seq_lens
        fb.seq_lens_cpu = seq_lens.cpu()
        fb.seq_lens_sum = sum(prefix_cpu) + sum(ext_cpu)
        fb.extend_num_tokens = sum(ext_cpu)
        fb.extend_seq_lens = ext
        fb.extend_prefix_lens = prefix
        fb.extend_start_loc = torch.cumsum(ext, 0) - ext
        fb.extend_seq_lens_cpu = ext_cpu
        fb.extend_prefix_lens_cpu = prefix_cpu
        fb.extend_logprob_start_lens_cpu = list(ext_cpu)
        fb.dllm_prompt_mask = None
        fb.rids = None
        fb.return_logprob = False
        out = runner.forward(fb)
        self._last_output = out.logits_output
        logits = out.logits_output.full_logits[:, : self.vocab_size].float()
        sizes = [p.input_ids.numel() for p in parts]
        return [part.view(*p.input_ids.shape, -1)
                for p, part in zip(parts, logits.split(sizes))]


Algorithm = ReFusion
