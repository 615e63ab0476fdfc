"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's
last ``n`` tokens (an n-gram match), with no forward at all.

Design notes: docs/design/core.md (section ``diffspec/core/lookup.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["LookupStats", "PromptLookup", "lookup_drafts", "ngram_lookup",
           "prompt_lookup_settings"]


@dataclass(frozen=True)
class PromptLookup:
    """The n-gram sizes a lookup matches: the longest suffix of ``min .. max`` tokens that
    occurred earlier in the context (the speculative config's ``"prompt_lookup": {"min":
    2, "max": 4}``)."""

    min: int = 2
    max: int = 4

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"set prompt_lookup {name} to an int >= 1, got {value!r}")
        if self.min > self.max:
            raise ValueError(f"set prompt_lookup min <= max, got min={self.min} max={self.max}")

    def as_dict(self) -> dict[str, int]:
        return {"min": self.min, "max": self.max}


def prompt_lookup_settings(value: Any, method: str, default: bool = True) -> PromptLookup | None:
    """The ``"prompt_lookup"`` option of a speculative config: ``false`` (off), ``true`` or
    ``{"min": m, "max": n}`` (on; the sizes default to 2 and 4), absent / ``None``: on
    when ``default``. TiDAR takes none: its drafts come from the verify forward itself
    (pre-drafted branches), so a lookup saves no forward there. Raises ``ValueError``
    saying what to change."""
    if value is None:
        value = default and method != "tidar"
    if value is False:
        return None
    if method == "tidar":
        raise ValueError("remove \"prompt_lookup\" (or set it false) for method 'tidar': its "
                         "drafts come free from the verify forward's branches, so a lookup "
                         "saves no forward; it applies to orthrus and linear_self_spec")
    if value is True:
        return PromptLookup()
    if isinstance(value, Mapping):
        unknown = set(value) - {"min", "max"}
        if unknown:
            raise ValueError(f"remove {', '.join(sorted(map(repr, unknown)))} from "
                             f"\"prompt_lookup\" (its keys: \"min\", \"max\")")
        return PromptLookup(**value)
    raise ValueError(f"set \"prompt_lookup\" to true, false or {{\"min\": 2, \"max\": 4}}, "
                     f"got {value!r}")


def ngram_lookup(
    tokens: Tensor,  # [B, T] row b's context is tokens[b, :lengths[b]] (the anchor last)
    lengths: Tensor,  # [B] context lengths
    num_drafts: Tensor,  # [B] most drafts to propose per row (0: none)
    settings: PromptLookup = PromptLookup(),
    with_ngram: bool = False,
) -> tuple[Tensor, ...]:  # drafts [B, max num_drafts] (-1 past the count), counts [B]
    """Prompt lookup for a batch, vectorised: for each row the longest n-gram (``n`` in
    ``settings.min .. settings.max``) that ends the context and also occurs earlier in it
    (overlaps allowed, but at least one token must follow it), and the tokens after that
    occurrence, at most ``num_drafts``. Among occurrences of that longest ``n``: the most
    recent one followed by ``num_drafts`` tokens, else (every one runs into the context's
    end) the one with the most tokens after it, the earliest. No match: count 0.
    ``with_ngram``: a third tensor ``[B]``, the matched ``n`` (0: no match), whose drafts
    the adaptive policy rates apart (a longer match is surer)."""
    device = tokens.device
    batch, width = tokens.shape
    lengths = lengths.to(device=device, dtype=torch.int64)
    num_drafts = num_drafts.to(device=device, dtype=torch.int64)
    k_max = int(num_drafts.max()) if batch else 0
    drafts = torch.full((batch, k_max), -1, dtype=torch.int64, device=device)
    counts = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch == 0 or k_max == 0 or width < 2:
        return (drafts, counts, counts.clone()) if with_ngram else (drafts, counts)
    ends = torch.arange(width, device=device)  # [T] e: where an occurrence ends
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])  # [B, 1] the anchor
    # earlier occurrences end on the anchor's token at e <= L - 2 (a token follows them)
    hit = (tokens == last) & (ends[None] <= (lengths - 2)[:, None])  # [B, T]
    rows, end = hit.nonzero(as_tuple=True)  # [H] candidates, few: one token's occurrences
    run = torch.ones_like(end)  # [H] matched length, up to settings.max
    alive = torch.ones_like(end, dtype=torch.bool)
    for j in range(1, settings.max):
        here, there = end - j, lengths[rows] - 1 - j  # [H] the j-th token back of each
        ok = here >= 0
        alive &= ok & (tokens[rows, here.clamp(min=0)] == tokens[rows, there.clamp(min=0)])
        run += alive.to(run.dtype)
    best = torch.zeros(batch, dtype=torch.int64, device=device).scatter_reduce(
        0, rows, run, "amax")  # [B] the longest n matched
    # one score per occurrence of the longest n, unique per row: the most recent followed
    # by num_drafts tokens (T + e) above the others by tokens after them (L - 1 - e < T)
    after = lengths[rows] - 1 - end  # [H] tokens after the occurrence
    score = torch.where(after >= num_drafts[rows], width + end, after)
    score = torch.where(run == best[rows], score, -1)
    top = torch.full((batch,), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, rows, score, "amax")  # [B]
    found = (best >= settings.min) & (num_drafts > 0) & (top >= 0)
    chosen = torch.where(top >= width, top - width, lengths - 1 - top)  # [B] its end
    counts = torch.where(found, torch.minimum(num_drafts, lengths - 1 - chosen), 0)
    columns = (chosen[:, None] + 1 + torch.arange(k_max, device=device)[None]).clamp(
        0, width - 1)  # [B, k_max]
    taken = torch.arange(k_max, device=device)[None] < counts[:, None]
    drafts = torch.where(taken, tokens.gather(1, columns).to(torch.int64), -1)
    if with_ngram:
        return drafts, counts, torch.where(counts > 0, best, 0)
    return drafts, counts


def lookup_drafts(contexts: Sequence[Sequence[int]], num_drafts: Sequence[int],
                  settings: PromptLookup = PromptLookup(),
                  with_ngram: bool = False) -> list[list[int]] | tuple[list[list[int]], list[int]]:
    """:func:`ngram_lookup` on token lists (``contexts[b]``: prompt + output, the anchor
    last): each row's lookup drafts (empty: no match); ``with_ngram``: and each row's
    matched n-gram length (0: no match)."""
    if not contexts:
        return ([], []) if with_ngram else []
    width = max(len(c) for c in contexts)
    tokens = torch.full((len(contexts), width), -1, dtype=torch.int64)  # [B, T]
    for b, context in enumerate(contexts):
        tokens[b, :len(context)] = torch.as_tensor(list(context), dtype=torch.int64)
    drafts, counts, ngram = ngram_lookup(
        tokens, torch.tensor([len(c) for c in contexts]),
        torch.tensor(list(num_drafts), dtype=torch.int64), settings, with_ngram=True)
    found = [row[:n].tolist() for row, n in zip(drafts, counts.tolist())]
    return (found, ngram.tolist()) if with_ngram else found


@dataclass
class LookupStats:
    """What a proposer drafted from: draft blocks (one request's drafts in one step) by
    lookup, by the diffusion view and carried over from the diffusion view's last block
    (:mod:`diffspec.core.carry`), and steps that drafted with no diffusion forward."""

    lookup_blocks: int = 0  # request-steps drafted by prompt lookup
    lookup_tokens: int = 0  # their draft tokens
    diffusion_blocks: int = 0  # request-steps drafted by the diffusion view
    carried_blocks: int = 0  # request-steps drafted by carried drafts
    carried_tokens: int = 0  # their draft tokens
    steps: int = 0  # steps that drafted at all
    forwards_skipped: int = 0  # of those, steps with lookup drafts only (no draft forward)

    def record(self, lookup: Sequence[int], diffusion: int,
               carried: Sequence[int] = ()) -> bool:
        """One step: ``lookup`` the lookup draft count of each request that drafted by
        lookup, ``diffusion`` the number of requests the diffusion view drafted for,
        ``carried`` the carried draft count of each request that took carried drafts. True
        when a log line of the totals is due: drafting steps 1, 2, 4, 8, ..., then every
        1000th (a few lines, not one per step)."""
        if not lookup and not diffusion and not carried:
            return False
        self.steps += 1
        self.carried_blocks += len(carried)
        self.carried_tokens += sum(carried)
        self.lookup_blocks += len(lookup)
        self.lookup_tokens += sum(lookup)
        self.diffusion_blocks += diffusion
        self.forwards_skipped += diffusion == 0
        return self.steps & (self.steps - 1) == 0 or self.steps % 1000 == 0

    def summary(self) -> str:
        """Where the draft blocks came from; a source that drafted nothing is left out."""
        total = self.lookup_blocks + self.diffusion_blocks + self.carried_blocks
        sources = [f"{n} {name}" + (f" ({tokens} tokens)" if tokens is not None else "")
                   for n, name, tokens in ((self.diffusion_blocks, "by the draft pass", None),
                                           (self.lookup_blocks, "by prompt lookup",
                                            self.lookup_tokens),
                                           (self.carried_blocks, "carried", self.carried_tokens))
                   if n]
        return (f"{total} draft blocks ({', '.join(sources) or 'none'}); "
                f"{self.forwards_skipped} of {self.steps} drafting steps ran no draft forward")
