"""The latency profile (seconds per forward by query tokens) and how a method's step
turns draft counts into forwards (:class:`StepCost`)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["LatencyProfile", "StepCost", "load_latency_profile"]


@dataclass(frozen=True)
class LatencyProfile:
    """Seconds per forward as a function of its query tokens (all requests together),
    piecewise linear between measured points and extrapolated from the last two beyond
    them (:func:`_interpolate`); for quadratic steps, optionally by requests and drafts
    (``step_grid``). Built from :mod:`benchmarks.profile_forward` tables or measured
    through an engine (``benchmarks/adaptive_sweep.py``)."""

    points: Mapping[int, float]  # query tokens -> seconds per forward (a whole engine step)
    # query tokens -> seconds of a draft pass, where it was measured apart (an engine's
    # draft pass has no sampler or scheduler step, or extra work such as copying K/V);
    # None: a draft pass costs what a forward of as many tokens does
    draft_points: Mapping[int, float] | None = None
    # query tokens -> seconds of a verify forward of drafted blocks, where it was measured
    # apart (SGLang's torch-native backend runs a verify as an extend over the whole
    # sequence); a verify step costs at least a plain step of as many tokens
    verify_points: Mapping[int, float] | None = None
    # requests in the step -> {drafts k >= 1 -> seconds of a whole engine step (as
    # ``points``: scheduler to scheduler) in which every request verifies k drafts and
    # pre-drafts k (TiDAR's quadratic step, steady state)}; None: quadratic steps are
    # priced by their query tokens (verify_points)
    step_grid: Mapping[int, Mapping[int, float]] | None = None

    def __post_init__(self) -> None:
        for name, table in (("points", self.points), ("draft_points", self.draft_points),
                            ("verify_points", self.verify_points),
                            *((f"step_grid[{b}]", row)
                              for b, row in (self.step_grid or {}).items())):
            if table is None and name in ("draft_points", "verify_points"):
                continue
            if not table:
                raise ValueError(f"a latency profile needs at least one measured point ({name})")
            if any(t < 1 or s <= 0 for t, s in table.items()):
                raise ValueError(f"profile {name} need tokens >= 1 and seconds > 0: {dict(table)}")
        if self.step_grid is not None and (not self.step_grid or min(self.step_grid) < 1):
            raise ValueError(f"profile step_grid needs rows of requests >= 1: "
                             f"{dict(self.step_grid)}")

    def __call__(self, tokens: int) -> float:
        """Seconds for one forward of ``tokens`` query tokens (0: no forward, 0 s)."""
        return _interpolate(self.points, tokens)

    def draft(self, tokens: int) -> float:
        """Seconds for one draft pass over ``tokens`` query tokens (0: none, 0 s)."""
        return _interpolate(self.draft_points or self.points, tokens)

    def verify(self, tokens: int) -> float:
        """Seconds for a step that verifies drafted blocks of ``tokens`` query tokens in
        all: the plain step's, or the measured verify forward's where that is more."""
        plain = _interpolate(self.points, tokens)
        return plain if not self.verify_points else max(
            plain, _interpolate(self.verify_points, tokens))

    def quadratic(self, requests: int, drafts: int) -> float:
        """Seconds for a whole step of ``requests`` requests that each verify ``drafts``
        drafts and pre-draft as many (``drafts = 0``: a plain AR step, ``self(requests)``)
        from ``step_grid``: within each measured batch size piecewise linear in the
        drafts, then between batch sizes piecewise linear in the requests (both as
        :func:`_interpolate`: below the first measured value its seconds, past the last
        the last two's line); never less than a plain AR step of as many requests."""
        if self.step_grid is None:
            raise ValueError("this latency profile has no step_grid")
        plain = self(requests)
        if drafts <= 0:
            return plain
        rows = {b: _interpolate(row, drafts) for b, row in self.step_grid.items()}
        return max(plain, _interpolate(rows, requests))


def _interpolate(points: Mapping[int, float], tokens: int) -> float:
    """Piecewise linear in ``points`` (the measured seconds at a measured point), the
    first point's seconds below it, extrapolated from the last two past the last but never
    below the last point's seconds (more tokens never cost less than the most measured);
    0 for no tokens."""
    if tokens <= 0:
        return 0.0
    xs = sorted(points)
    ys = [points[x] for x in xs]
    if len(xs) == 1 or tokens <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    line = y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return max(line, ys[-1]) if tokens > xs[-1] else line


@dataclass(frozen=True)
class StepCost:
    """How a method turns draft counts into forwards (see the module docstring)."""

    kind: Literal["linear", "two_pass", "quadratic"]
    skip: int = 0  # quadratic: 1 when the branch's first mask drafts nothing (unshifted)
    # two_pass: one width per step (SGLang's verify and draft forwards): every request's
    # block is padded to the widest, and a draft pass, when any request runs the drafter,
    # runs over every request's padded block, lookup rows included
    padded: bool = False

    def latency(self, profile: LatencyProfile, counts: Sequence[int],
                free: Sequence[bool] | None = None,
                widths: Sequence[int] | None = None) -> float:
        """Seconds for one step of requests drafting ``counts`` tokens each; ``free[r]``:
        request ``r``'s drafts cost no draft pass (prompt lookup, carried drafts), only
        their verify; ``widths[r]`` (two-pass): request ``r``'s draft block drafts that
        many tokens (at least its count: over-drafting, the rest carried to the next
        step), default its count."""
        verify = sum(1 + k for k in counts)
        if self.kind == "linear":  # e.g. a drafter whose own cost is negligible
            return profile(verify)
        if self.kind == "two_pass":  # Orthrus / NLD linear: draft forward + verify forward
            free = free or [False] * len(counts)
            widths = counts if widths is None else [max(k, w) for k, w in zip(counts, widths,
                                                                                strict=True)]
            drafted = sum(1 + w for k, w, f in zip(counts, widths, free, strict=True)
                          if k > 0 and not f)
            if self.padded and counts:
                verify = len(counts) * (1 + max(counts))
                drafted = len(counts) * (1 + max(widths)) if drafted else 0
            if drafted:
                return profile.draft(drafted) + profile.verify(verify)
            return profile.verify(verify) if any(counts) else profile(verify)
        # TiDAR: verify chain + one branch of k + skip masks per outcome, one forward,
        # in the steady state n = k; no request drafting: a plain AR step
        if not any(counts):
            return profile(len(counts))
        if profile.step_grid is not None:  # measured by requests and drafts
            return profile.quadratic(len(counts), max(counts))
        tokens = sum((1 + k) * (1 + (k + self.skip if k > 0 else 0)) for k in counts)
        return profile.verify(tokens)


def load_latency_profile(data: Mapping, context: int | None = None) -> LatencyProfile:
    """A :class:`LatencyProfile` from JSON data: ``{"points": {tokens: seconds},
    "draft_points": {...}, "verify_points": {...}, "step_grid": {requests: {drafts:
    seconds}}}`` (all but ``points`` optional, absent or empty alike; what
    ``benchmarks/adaptive_sweep.py`` measures through an engine), or the
    ``forward_latency.json`` of ``benchmarks/profile_forward.py`` (``latency_s[context]
    [query_len]``; the measured context nearest ``context``, default the smallest)."""
    if "points" in data:
        def table(rows: Mapping | None) -> dict[int, float] | None:
            return {int(t): float(s) for t, s in rows.items()} if rows else None
        grid = {int(b): table(row) for b, row in (data.get("step_grid") or {}).items()}
        return LatencyProfile(table(data["points"]), table(data.get("draft_points")),
                              table(data.get("verify_points")), grid or None)
    if "latency_s" in data:
        contexts = sorted(int(c) for c in data["latency_s"])
        ctx = contexts[0] if context is None else min(contexts, key=lambda c: abs(c - context))
        return LatencyProfile({int(q): float(s)
                               for q, s in data["latency_s"][str(ctx)].items()})
    raise ValueError("a latency profile is {\"points\": {tokens: seconds}} or the "
                     "forward_latency.json of benchmarks/profile_forward.py")
