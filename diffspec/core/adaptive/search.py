"""The draft-count search: the counts (one per request, or one for the step) that
maximise expected committed tokens per second under a latency profile."""

from __future__ import annotations

from collections.abc import Sequence

from diffspec.core.adaptive.acceptance import _expected_by_count, expected_tokens
from diffspec.core.adaptive.profile import LatencyProfile, StepCost

__all__ = ["choose_draft_counts", "choose_shared_draft_count", "choose_shared_draft_counts",
           "tokens_per_second"]


def tokens_per_second(acceptance: Sequence[float], k: int, profile: LatencyProfile,
                      cost: StepCost) -> float:
    """Expected committed tokens per second of one request drafting ``k`` tokens a step
    (``acceptance``: conditional, as for :func:`expected_tokens`)."""
    return expected_tokens(acceptance, k) / cost.latency(profile, [k])


def choose_draft_counts(
    acceptance: Sequence[Sequence[float]],  # [num_reqs][max_drafts] conditional acceptance
    max_drafts: Sequence[int],  # [num_reqs] most drafts each request may take this step
    profile: LatencyProfile,
    cost: StepCost,
    free: Sequence[bool] | None = None,  # [num_reqs] drafts that cost no draft pass
    pinned: Sequence[int | None] | None = None,  # [num_reqs] a count fixed in advance
) -> list[int]:
    """Draft counts ``[num_reqs]`` maximizing expected committed tokens per second
    (``pinned[r]``, where not None: request ``r`` drafts exactly that many, the others
    chosen around it). The draft pass is a fixed cost, paid once by every request that
    drafts from the drafter: the best step that pays it (a scan of the drafts, best gain
    first) is weighed against the best step that does not (the requests with drafts that
    cost no draft pass, :data:`free`, alone), so that a drafter's higher first gain does
    not commit the step to a draft pass that its gains do not repay."""
    return _choose_counts(acceptance, max_drafts, profile, cost, free, pinned)[1]


def _choose_counts(acceptance, max_drafts, profile, cost, free=None,
                   pinned=None) -> tuple[float, list[int]]:
    """(expected tokens per second, counts) of :func:`choose_draft_counts`."""
    n = len(max_drafts)
    if not n:
        return 0.0, []
    free = list(free) if free is not None else [False] * n
    pinned = list(pinned) if pinned is not None else [None] * n
    start = [p or 0 for p in pinned]
    limits = [s if p is not None else m for s, p, m in zip(start, pinned, max_drafts)]
    best = _scan(acceptance, start, limits, profile, cost, free)
    pass_pinned = any(s > 0 and not f for s, f in zip(start, free))
    if any(free) and not all(free) and not pass_pinned:
        # no draft pass: only the requests whose drafts are free may draft
        free_only = _scan(acceptance, start,
                          [m if f else s for m, f, s in zip(limits, free, start)],
                          profile, cost, free)
        if free_only[0] > best[0] * (1 + 1e-9):
            best = free_only
    return best


def _scan(acceptance, start: list[int], limits: list[int], profile, cost,
          free: list[bool]) -> tuple[float, list[int]]:
    """The gain-sorted prefix scan: from ``start``, each request's next draft in order of
    its gain ``prod_{i<=j} a_r(i)``, keeping the count vector whose expected tokens per
    second is highest (tokens: ``sum_r E_r(count_r)``)."""
    counts = list(start)
    gains = []  # (gain, request, draft index)
    tokens = 0.0
    for r, (acc, limit) in enumerate(zip(acceptance, limits)):
        totals = _expected_by_count(acc, limit)
        tokens += totals[counts[r]]
        for j in range(counts[r], limit):
            gains.append((totals[j + 1] - totals[j], r, j))
    gains.sort(key=lambda g: (-g[0], g[2], g[1]))  # best gain first; per request in order
    best_rate = tokens / cost.latency(profile, counts, free)
    best = list(counts)
    for gain, r, j in gains:
        if gain <= 0.0:
            break
        if j != counts[r]:  # gains of one request are non-increasing: keep them in order
            continue
        counts[r] += 1
        tokens += gain
        rate = tokens / cost.latency(profile, counts, free)
        if rate > best_rate * (1 + 1e-9):
            best_rate, best = rate, list(counts)
    return best_rate, best


def choose_shared_draft_count(
    acceptance: Sequence[Sequence[float]], max_drafts: Sequence[int], profile: LatencyProfile,
    cost: StepCost, free: Sequence[bool] | None = None,
) -> int:
    """One draft count for every request of the step (engines whose verify forward has one
    width per step, e.g. SGLang's linear verify, and both engines' TiDAR steps): the ``k``
    maximizing expected committed tokens per second when the step is priced as every
    request drafting ``k`` (``cost.latency`` of ``[k] * num_reqs``) and request ``r``
    drafts ``min(k, max_drafts[r])``. Ties go to fewer drafts; 0 = a plain AR step for the
    whole batch. The arguments are :func:`choose_draft_counts`'s. (With free drafts,
    :func:`choose_shared_draft_counts` also weighs a step in which only they draft.)"""
    return _choose_shared(acceptance, max_drafts, profile, cost, free, lookup_only=False)[0]


def choose_shared_draft_counts(
    acceptance: Sequence[Sequence[float]], max_drafts: Sequence[int], profile: LatencyProfile,
    cost: StepCost, free: Sequence[bool] | None = None,
) -> tuple[int, list[int]]:
    """:func:`choose_shared_draft_count` that also weighs, for each ``k``, the step in
    which only the requests with free drafts draft (``min(k, max_drafts[r])``) and the
    others take none, so no draft pass runs: the step's ``k`` and each request's count."""
    k, lookup_only = _choose_shared(acceptance, max_drafts, profile, cost, free,
                                    lookup_only=True)
    free = list(free) if free is not None else [False] * len(max_drafts)
    return k, [min(k, m) if f or not lookup_only else 0 for m, f in zip(max_drafts, free)]


def _choose_shared(acceptance, max_drafts, profile, cost, free,
                   lookup_only: bool) -> tuple[int, bool]:
    """(``k``, whether the best step is the free drafts' alone) of the shared count."""
    if not max_drafts:
        return 0, False
    n = len(max_drafts)
    free = list(free) if free is not None else [False] * n
    committed = [_expected_by_count(acc, limit)  # [num_reqs][limit + 1] E(0 .. limit)
                 for acc, limit in zip(acceptance, max_drafts, strict=True)]
    best, best_rate = (0, False), n / cost.latency(profile, [0] * n, free)
    variants = [False, True] if lookup_only and any(free) and not all(free) else [False]
    for k in range(1, max(max_drafts) + 1):
        for alone in variants:
            counts = [0 if alone and not f else min(k, m) for m, f in zip(max_drafts, free)]
            tokens = sum(e[c] for e, c in zip(committed, counts))
            rate = tokens / cost.latency(profile, counts if cost.padded else
                                         [0 if alone and not f else k for f in free], free)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = (k, alone), rate
    return best
