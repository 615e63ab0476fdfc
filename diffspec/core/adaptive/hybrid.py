"""The draft sources (the method's drafter, prompt lookup) and the rule of a seeded
request's drafts (its own history and the server's profile only)."""

from __future__ import annotations

from collections.abc import Sequence

from diffspec.core.adaptive.acceptance import _expected_by_count
from diffspec.core.adaptive.profile import LatencyProfile, StepCost

__all__ = ["SOURCES", "seeded_draft_count"]

# where a request's drafts come from: its drafter, prompt lookup, or the tail of its last
# draft block (diffspec.core.carry)
SOURCES = ("draft", "lookup", "carry")


def _draft_pass(counts: Sequence[int], lookup: Sequence[bool]) -> bool:
    """Does a step with these draft counts run the drafter (a request drafting, not from
    prompt lookup)?"""
    return any(k > 0 and not f for k, f in zip(counts, lookup, strict=True))


def seeded_draft_count(acceptance: Sequence[float], limit: int, profile: LatencyProfile,
                       cost: StepCost, free: bool = False) -> tuple[int, float]:
    """The draft count of a seeded request (:meth:`AdaptiveDrafts.choose_hybrid`) and its
    expected tokens per second: the best count for the request priced as a step of its own
    on the server's latency profile (``free``: its drafts cost no draft pass), by its own
    acceptance estimate. The profile is fixed for the server's life (measured once at
    start-up, reused from the cache on the next start, or the user's), so the count is a
    function of the request's history, never of the clock while it is served; ties go to
    fewer drafts."""
    totals = _expected_by_count(acceptance, limit)
    best, best_rate = 0, totals[0] / cost.latency(profile, [0], [free])
    for k in range(1, limit + 1):
        rate = totals[k] / cost.latency(profile, [k], [free])
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best, best_rate
