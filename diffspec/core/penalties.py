"""Per-request logit transforms on the verify rows of a speculative step (penalties,
``min_new_tokens``, logit bias), as an engine's AR path applies them one token at a time.

Design notes: docs/design/core.md (section ``diffspec/core/penalties.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["RequestPenalties", "apply_penalties_per_row", "needs_penalties"]


@dataclass(frozen=True)
class RequestPenalties:
    """One request's options (the neutral values turn each off)."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logit_bias: dict[int, float] | None = None

    @property
    def is_neutral(self) -> bool:
        return (self.repetition == 1.0 and self.frequency == 0.0 and self.presence == 0.0
                and self.min_new_tokens <= 0 and not self.logit_bias)


def needs_penalties(penalties: Sequence[RequestPenalties]) -> bool:
    return any(not p.is_neutral for p in penalties)


def _history_index(histories: Sequence[Sequence[int]], vocab: int,
                   device: torch.device) -> Tensor:  # [bs, max_len], padding -> vocab
    longest = max((len(h) for h in histories), default=0)
    index = torch.full((len(histories), max(longest, 1)), vocab, dtype=torch.int64)
    for b, history in enumerate(histories):
        if history:
            index[b, : len(history)] = torch.as_tensor(list(history), dtype=torch.int64)
    return index.to(device)


def apply_penalties_per_row(
    logits: Tensor,  # [bs, W, vocab] float32, modified in place
    drafts: Tensor,  # [bs, W - 1] the drafts scored by rows 1 .. W - 1
    histories: Sequence[Sequence[int]],  # [bs] output tokens so far (the anchor last)
    penalties: Sequence[RequestPenalties],  # [bs]
) -> Tensor:  # logits
    """Apply each request's penalties and bias to its verify rows (module docstring), row
    ``j`` with ``histories[b] + drafts[b, :j]`` as its output so far."""
    bs, width, vocab = logits.shape
    if len(histories) != bs or len(penalties) != bs or drafts.shape[0] != bs:
        raise ValueError(f"{bs} requests in the logits, {len(histories)} histories, "
                         f"{len(penalties)} penalty sets, {drafts.shape[0]} draft rows")
    if drafts.shape[1] < width - 1:
        raise ValueError(f"{width} verify rows need {width - 1} drafts, got {drafts.shape[1]}")
    if not needs_penalties(penalties):
        return logits
    device = logits.device

    def column(values: list[float]) -> Tensor:  # [bs, 1]
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    frequency = column([p.frequency for p in penalties])
    presence = column([p.presence for p in penalties])
    repetition = column([p.repetition for p in penalties])
    additive = bool((frequency != 0).any() or (presence != 0).any())
    scaling = bool((repetition != 1).any())
    min_tokens = torch.tensor([p.min_new_tokens for p in penalties], device=device)
    banning = any(p.min_new_tokens > 0 for p in penalties)
    lengths = torch.tensor([len(h) for h in histories], device=device)

    # the state after the history (padding scatters into an extra column, dropped)
    index = _history_index(histories, vocab, device)  # [bs, L]
    freq_state = torch.zeros(bs, vocab + 1, device=device)
    freq_state.scatter_add_(1, index, frequency.expand_as(index).contiguous())
    pres_state = torch.zeros(bs, vocab + 1, device=device)
    pres_state.scatter_(1, index, presence.expand_as(index).contiguous())
    rep_state = torch.ones(bs, vocab + 1, device=device)
    rep_state.scatter_(1, index, repetition.expand_as(index).contiguous())
    freq_state, pres_state, rep_state = (s[:, :vocab].contiguous()
                                         for s in (freq_state, pres_state, rep_state))
    stop_ban = torch.zeros(bs, vocab, device=device)
    if banning:
        for b, p in enumerate(penalties):
            ids = [t for t in p.stop_token_ids if 0 <= t < vocab]
            if p.min_new_tokens > 0 and ids:
                stop_ban[b, ids] = float("-inf")
    bias = None
    if any(p.logit_bias for p in penalties):
        bias = torch.zeros(bs, vocab, device=device)
        for b, p in enumerate(penalties):
            for token, value in (p.logit_bias or {}).items():
                if 0 <= int(token) < vocab:
                    bias[b, int(token)] = float(value)

    for j in range(width):
        row = logits[:, j]  # [bs, vocab] view
        if additive or banning:
            acc = torch.zeros(bs, vocab, device=device)
            if additive:
                acc.sub_(freq_state)
                acc.sub_(pres_state)
            if banning:
                acc.add_(torch.where((lengths + j < min_tokens)[:, None], stop_ban, 0.0))
            row.add_(acc)
        if scaling:
            row.copy_(torch.where(row < 0, row * rep_state, row / rep_state))
        if bias is not None:
            row.add_(bias)
        if j < width - 1:  # row j + 1 has d_{j+1} in its history
            token = drafts[:, j: j + 1].to(torch.int64)  # [bs, 1]
            freq_state.scatter_add_(1, token, frequency)
            pres_state.scatter_(1, token, presence)
            rep_state.scatter_(1, token, repetition)
    return logits
