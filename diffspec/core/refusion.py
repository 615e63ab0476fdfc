"""ReFusion's decoding rounds (plan, verify, parallel completion, commit, finish), engine-free.

Design notes: docs/design/core.md (section ``diffspec/core/refusion.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from diffspec.core.slots import (
    committed_slot_lengths,
    first_stop_in_slots,
    score_slots,
    select_slots,
    verify_slot_drafts,
)

__all__ = ["LogitsForwards", "SlotForwards", "SlotRule", "SlotRun", "refusion_decode",
           "slot_output"]

# What an engine's forward generators yield (its own forward requests) and are sent back.
_Forward = Generator[Any, Any, Any]


class SlotRule(NamedTuple):
    """ReFusion's decoding knobs, as the reference's ``ReFusionConfig`` holds them."""

    slot_size: int
    num_blocks: int  # serial blocks
    slot_threshold: float  # plan: slots whose first-token probability is over it
    token_threshold: float  # verify: drafts whose causal probability is over it
    mask_token_id: int

    @classmethod
    def of(cls, settings: Mapping[str, Any], mask_token_id: int) -> SlotRule:
        """From resolved settings (``slot_size``, ``num_blocks`` and the two thresholds)."""
        return cls(int(settings["slot_size"]), int(settings["num_blocks"]),
                   float(settings["slot_threshold"]), float(settings["token_threshold"]),
                   int(mask_token_id))


@dataclass(kw_only=True)
class SlotRun:
    """One request's decoding state; each engine's request state extends it."""

    prompt_len: int = 0  # slot 0's first position; the KV entries before the generation
    device: torch.device | str = "cpu"
    masked: list[int] = field(default_factory=list)  # still-masked slots of the serial block
    slot_tokens: dict[int, list[int]] = field(default_factory=dict)  # committed (cut at a stop)
    committed: int = 0  # KV entries of the generation holding committed tokens
    stopped: bool = False  # a stop token was committed: no later serial block

    @property
    def kv_len(self) -> int:
        return self.prompt_len + self.committed


class SlotForwards(ABC):
    """One request's engine forwards for :func:`refusion_decode`. Each forward is a
    generator: it yields the engine's own forward requests (to whatever drives the
    decoder), is sent their results, and returns what the rule reads. Every forward runs
    causally over the request's committed KV (``kv_len`` entries); ``input_ids`` and
    ``positions`` are ``[rows, slot_size]``. The hooks (no-ops here) let an engine keep
    its KV and its trace in step."""

    @abstractmethod
    def plan(self, input_ids: Tensor, positions: Tensor) -> _Forward:
        """The masked slots (``input_ids`` all masks), their K/V not kept; returns the plan
        scores ``[m]`` (:func:`~diffspec.core.slots.score_slots`) and the argmax
        ``[m, slot_size]``."""

    @abstractmethod
    def verify(self, input_ids: Tensor, positions: Tensor) -> _Forward:
        """The chosen drafts, one slot after another as one causal sequence, writing their
        K/V after the committed entries; returns per slot the causal probability of each
        draft after its first ``[k, slot_size - 1]`` (of token ``j + 1`` at row ``j``)."""

    @abstractmethod
    def draft(self, input_ids: Tensor, positions: Tensor, start: int) -> _Forward:
        """Parallel completion's draft pass: each row alone over the committed KV and its
        own entries before ``start``, its window ``[start:]`` fed (masks at the open
        positions); returns the window's argmax ``[rows, slot_size - start]``."""

    @abstractmethod
    def check(self, input_ids: Tensor, positions: Tensor, start: int) -> _Forward:
        """Parallel completion's verify pass, laid out as :meth:`draft`; returns the causal
        probability of each window token after the first ``[rows, slot_size - start - 1]``."""

    def open_rows(self, rows: int) -> _Forward:
        """Parallel completion starts with ``rows`` rows, after a verify that committed
        nothing (it may wait, yielding, for the engine's resources)."""
        yield from ()

    def keep_rows(self, rows: int) -> None:
        """A stop ended the completion's rows after the first ``rows``."""

    def close_rows(self) -> None:
        """Parallel completion is over (also when the decoder is closed inside it)."""

    def verified(self, before: Tensor | None, accepted: Tensor) -> None:
        """An acceptance: ``accepted`` tokens per row ``[rows]``, ``before`` (None: 0) it."""

    def commit(self, slots: Tensor, keep: list[int], parallel: bool) -> None:
        """``slots`` [n] commit their first ``keep`` tokens, from the verify pass's K/V
        (``parallel`` False) or from the completion rows (True); called before the run
        records them."""


class LogitsForwards(SlotForwards):
    """:class:`SlotForwards` over one engine forward that returns fp32 logits (the
    reference's, SGLang's): :meth:`forward` runs every row causally over the committed KV
    and the row's own first ``start`` entries, writing its K/V after them."""

    @abstractmethod
    def forward(self, input_ids: Tensor, positions: Tensor, start: int) -> _Forward:
        """``input_ids`` at ``positions`` (``[rows, n]``); returns the logits
        ``[rows, n, vocab]`` (fp32)."""

    def plan(self, input_ids: Tensor, positions: Tensor) -> _Forward:
        m, S = positions.shape
        logits = yield from self.forward(input_ids.view(1, -1), positions.view(1, -1), 0)
        logits = logits.view(m, S, -1)
        scores, _ = score_slots(logits[:, 0])
        return scores, logits.argmax(dim=-1)

    def verify(self, input_ids: Tensor, positions: Tensor) -> _Forward:
        k, S = positions.shape
        logits = yield from self.forward(input_ids.view(1, -1), positions.view(1, -1), 0)
        return _next_token_probs(logits.view(k, S, -1), input_ids)

    def draft(self, input_ids: Tensor, positions: Tensor, start: int) -> _Forward:
        logits = yield from self.forward(input_ids[:, start:], positions[:, start:], start)
        return logits.argmax(-1)

    def check(self, input_ids: Tensor, positions: Tensor, start: int) -> _Forward:
        window = input_ids[:, start:]
        logits = yield from self.forward(window, positions[:, start:], start)
        return _next_token_probs(logits, window)


def _next_token_probs(logits: Tensor, input_ids: Tensor) -> Tensor:  # [rows, n - 1]
    """Each row's softmax probability of its next input token: of ``input_ids[:, j + 1]``
    under ``logits[:, j]`` (``logits`` [rows, n, vocab] fp32, ``input_ids`` [rows, n])."""
    return torch.softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def refusion_decode(run: SlotRun, rule: SlotRule, forwards: SlotForwards, max_tokens: int,
                    stops: Sequence[int]) -> _Forward:
    """A request's serial blocks, round after round, until each block's slots are all
    committed or a stop token is; read the output with :func:`slot_output`."""
    per_block = -(-max_tokens // rule.slot_size) // rule.num_blocks
    for serial in range(rule.num_blocks):
        run.masked = list(range(serial * per_block, (serial + 1) * per_block))
        while run.masked:
            yield from _round(run, rule, forwards, stops)
        if run.stopped:
            break


def slot_output(run: SlotRun, stops: Sequence[int], max_tokens: int) -> list[int]:
    """The slots in original order, cut after the first stop and at ``max_tokens``."""
    tokens: list[int] = []
    slot = 0
    while slot in run.slot_tokens:  # only slots after a stop are never generated
        tokens += run.slot_tokens[slot]
        slot += 1
    for i, t in enumerate(tokens):
        if t in stops:
            tokens = tokens[: i + 1]
            break
    return tokens[:max_tokens]


def _round(run: SlotRun, rule: SlotRule, forwards: SlotForwards, stops: Sequence[int]
           ) -> _Forward:
    """Plan, global verify, parallel completion: commits at least one slot (or a slot cut
    at a stop)."""
    S, device, mask = rule.slot_size, run.device, rule.mask_token_id

    # plan: the masked slots (original order, true positions) over the committed KV
    masked = torch.tensor(run.masked, device=device)  # [m]
    positions = run.prompt_len + masked[:, None] * S + torch.arange(S, device=device)  # [m, S]
    scores, argmax = yield from forwards.plan(torch.full_like(positions, mask), positions)
    chosen = select_slots(scores, rule.slot_threshold).nonzero().flatten()  # ascending
    slots, positions = masked[chosen], positions[chosen]  # [k], [k, S]
    drafts = argmax[chosen]  # [k, S]

    # global verify: the drafts one after another, causally, writing their KV in place
    probs = yield from forwards.verify(drafts, positions)
    accepted = _accept(drafts, probs, 0, rule.token_threshold, forwards)
    stop_at = first_stop_in_slots(drafts, accepted, stops)  # [k], -1 = none
    keep, stopped = committed_slot_lengths(accepted, stop_at, S)  # leading complete slots
    if keep:
        lead = len(keep)
        _commit(run, forwards, slots[:lead], drafts[:lead], keep, stopped, parallel=False)
        return

    # parallel completion: one row per chosen slot, each over the committed KV only
    tokens, rows = drafts.clone(), len(slots)
    keep, stopped = [S] * rows, False
    yield from forwards.open_rows(rows)
    try:
        start = 0  # window start: positions before it are final in every row
        while int(accepted.min()) < S:
            open_ = torch.arange(S, device=device)[None] >= accepted[:, None]  # [rows, S]
            proposed = yield from forwards.draft(torch.where(open_, mask, tokens), positions,
                                                 start)
            tokens[:, start:] = torch.where(open_[:, start:], proposed, tokens[:, start:])
            probs = yield from forwards.check(tokens, positions, start)
            accepted = _accept(tokens, probs, start, rule.token_threshold, forwards, accepted)
            stop_at = first_stop_in_slots(tokens, accepted, stops)
            if bool((stop_at >= 0).any()):  # rows after the first stop are dropped
                stopped, rows = True, int((stop_at >= 0).nonzero()[0]) + 1
                tokens, positions, accepted = tokens[:rows], positions[:rows], accepted[:rows]
                keep = [S] * (rows - 1) + [int(stop_at[rows - 1]) + 1]
                accepted[-1] = S
                slots = slots[:rows]
                forwards.keep_rows(rows)
            start = int(accepted.min())  # first open position of the slowest row
    finally:
        forwards.close_rows()
    _commit(run, forwards, slots, tokens, keep, stopped, parallel=True)


def _accept(tokens: Tensor, next_probs: Tensor, start: int, threshold: float,
            forwards: SlotForwards, accepted: Tensor | None = None) -> Tensor:  # [rows]
    """Token-threshold acceptance of ``tokens`` [rows, S] from a causal pass over the window
    ``[start:]`` (``next_probs`` [rows, S - start - 1]); ``accepted`` before it (None: 0)."""
    probs = torch.ones(tokens.shape, dtype=next_probs.dtype, device=tokens.device)
    probs[:, start + 1 :] = next_probs  # positions <= accepted are ignored by the rule
    new = verify_slot_drafts(tokens, probs, threshold, accepted)
    forwards.verified(accepted, new)
    return new


def _commit(run: SlotRun, forwards: SlotForwards, slots: Tensor, tokens: Tensor,
            keep: list[int], stopped: bool, parallel: bool) -> None:
    """Record committed slots (their KV is in the cache, in this order: the engine's)."""
    forwards.commit(slots, keep, parallel)
    for slot, row, k in zip(slots.tolist(), tokens.tolist(), keep):
        run.slot_tokens[slot] = row[:k]
        run.masked.remove(slot)
        run.committed += k
    if stopped:  # nothing after the stop slot will be generated
        run.stopped = True
        last = int(slots[-1])
        run.masked = [s for s in run.masked if s < last]
