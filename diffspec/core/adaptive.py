"""Adaptive draft length: how many tokens each request drafts this step, given the load.

Design notes: docs/design/core.md (section ``diffspec/core/adaptive.py``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CHECKPOINT_ACCEPTANCE_KEY",
    "SOURCES",
    "AcceptanceEstimate",
    "AdaptiveDrafts",
    "LatencyProfile",
    "StepCost",
    "StepTimeFit",
    "checkpoint_prior",
    "choose_draft_counts",
    "choose_shared_draft_count",
    "conditional_acceptance",
    "expected_tokens",
    "load_latency_profile",
    "measured_prior",
    "tokens_per_second",
]


# the config.json key of a checkpoint whose drafts' acceptance per position was measured
# (written by diffspec's materialize_orthrus from heads.json's acceptance_per_position)
CHECKPOINT_ACCEPTANCE_KEY = "diffspec_draft_acceptance"
SOURCES = ("draft", "lookup")  # where a request's drafts come from: its drafter, prompt lookup


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

    def latency(self, profile: LatencyProfile, counts: Sequence[int],
                free: Sequence[bool] | None = None) -> float:
        """Seconds for one step of requests drafting ``counts`` tokens each; ``free[r]``:
        request ``r``'s drafts cost no draft pass (prompt lookup), only their verify."""
        verify = sum(1 + k for k in counts)
        if self.kind == "linear":  # e.g. a drafter whose own cost is negligible
            return profile(verify)
        if self.kind == "two_pass":  # Orthrus / NLD linear: draft forward + verify forward
            free = free or [False] * len(counts)
            drafted = sum(1 + k for k, f in zip(counts, free, strict=True) if k > 0 and not f)
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


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """``1 + sum_{j<=k} prod_{i<=j} a(i)``: tokens a step with ``k`` drafts commits in
    expectation (``acceptance[i]``: conditional acceptance of draft ``i + 1``)."""
    return _expected_by_count(acceptance, k)[k]


def _expected_by_count(acceptance: Sequence[float], k: int) -> list[float]:
    """``[E(0), E(1) .. E(k)]`` (:func:`expected_tokens`), in one pass."""
    totals, survive = [1.0], 1.0
    for i in range(k):
        survive *= acceptance[i] if i < len(acceptance) else 0.0
        totals.append(totals[-1] + survive)
    return totals


def conditional_acceptance(per_position: Sequence[float]) -> list[float]:
    """``a(i)`` from the acceptance per draft position as vLLM counts it
    (``num_accepted_tokens_per_pos[j] / num_drafts``: the share of verify steps in which
    drafts ``0 .. j`` were all accepted): ``a(j) = p(j) / p(j - 1)``, clamped to [0, 1]
    (0 after a position that was never reached)."""
    conditional, previous = [], 1.0
    for p in per_position:
        p = min(max(float(p), 0.0), 1.0)
        conditional.append(min(p / previous, 1.0) if previous > 0 else 0.0)
        previous = p
    return conditional


def measured_prior(per_position: Sequence[float] | None, floor: float = 0.05,
                   ceiling: float = 0.95) -> list[float] | None:
    """The :class:`AcceptanceEstimate` prior of a drafter whose acceptance per position was
    measured (``per_position`` as vLLM counts it, :func:`conditional_acceptance`), each rate
    kept within ``[floor, ceiling]``: a position measured at 0 still gets tried once the
    earlier ones accept more than they did there, and none is taken as certain. ``None``
    (nothing measured, or not a list of rates): no prior of the checkpoint's own."""
    if not per_position or not isinstance(per_position, (list, tuple)):
        return None
    try:
        rates = conditional_acceptance([float(p) for p in per_position])
    except (TypeError, ValueError):
        return None
    return [min(max(a, floor), ceiling) for a in rates]


def checkpoint_prior(hf_config) -> list[float] | None:
    """:func:`measured_prior` of the acceptance per position a checkpoint's config.json
    records (:data:`CHECKPOINT_ACCEPTANCE_KEY`; ``hf_config``: the engine's config object,
    or a dict), else ``None``."""
    if isinstance(hf_config, Mapping):
        return measured_prior(hf_config.get(CHECKPOINT_ACCEPTANCE_KEY))
    return measured_prior(getattr(hf_config, CHECKPOINT_ACCEPTANCE_KEY, None))


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
) -> list[int]:
    """Draft counts ``[num_reqs]`` maximizing expected committed tokens per second."""
    counts = [0] * len(max_drafts)
    if not counts:
        return counts
    gains = []  # (gain, request, draft index): prod_{i<=j} a_r(i)
    for r, (acc, limit) in enumerate(zip(acceptance, max_drafts)):
        survive = 1.0
        for j in range(limit):
            survive *= acc[j] if j < len(acc) else 0.0
            gains.append((survive, r, j))
    gains.sort(key=lambda g: (-g[0], g[2], g[1]))  # best gain first; per request in order

    best_rate = len(counts) / cost.latency(profile, counts, free)
    best = list(counts)
    tokens = float(len(counts))
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
    return best


def choose_shared_draft_count(
    acceptance: Sequence[Sequence[float]],  # [num_reqs][max_drafts] conditional acceptance
    max_drafts: Sequence[int],  # [num_reqs] most drafts each request may take this step
    profile: LatencyProfile,
    cost: StepCost,
    free: Sequence[bool] | None = None,  # [num_reqs] drafts that cost no draft pass
) -> int:
    """One draft count for every request of the step (engines whose verify forward has one
    width per step, e.g. SGLang's linear verify, and both engines' TiDAR steps): the ``k``
    maximizing expected committed tokens per second when the step is priced as every
    request drafting ``k`` (``cost.latency`` of ``[k] * num_reqs``) and request ``r``
    drafts ``min(k, max_drafts[r])``. Ties go to fewer drafts; 0 = a plain AR step for the
    whole batch."""
    if not max_drafts:
        return 0
    n = len(max_drafts)
    committed = [_expected_by_count(acc, limit)  # [num_reqs][limit + 1] E(0 .. limit)
                 for acc, limit in zip(acceptance, max_drafts, strict=True)]
    best_k, best_rate = 0, n / cost.latency(profile, [0] * n, free)
    for k in range(1, max(max_drafts) + 1):
        tokens = sum(e[min(k, len(e) - 1)] for e in committed)
        rate = tokens / cost.latency(profile, [k] * n, free)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


@dataclass
class AcceptanceEstimate:
    """Running estimate of the conditional acceptance of each draft position, from verify
    outcomes (``(drafts proposed, drafts accepted)`` per request and step, which both
    engines report). Each position keeps exponentially weighted counts of trials (the
    position was verified: every earlier draft was accepted) and successes, starting from a
    prior of ``prior_weight`` pseudo-trials at ``prior``: one rate for every position
    (optimistic by default, so a fresh server drafts and measures), or one per position
    (:func:`measured_prior`: what the checkpoint's drafts were measured to accept; the
    positions past the list take its last rate)."""

    max_drafts: int
    prior: float | Sequence[float] = 0.8
    prior_weight: float = 4.0
    decay: float = 0.999  # per update; ~1000 verify outcomes of memory
    trials: list[float] = field(init=False)
    successes: list[float] = field(init=False)

    def __post_init__(self) -> None:
        rates = [self.prior] if isinstance(self.prior, (int, float)) else list(self.prior)
        if (not rates or not all(0.0 <= r <= 1.0 for r in rates) or self.prior_weight <= 0
                or not 0 < self.decay <= 1):
            raise ValueError("prior in [0, 1] (one rate, or one per position), prior_weight "
                             "> 0 and decay in (0, 1] needed")
        rates = [float(rates[min(i, len(rates) - 1)]) for i in range(self.max_drafts)]
        self.trials = [self.prior_weight] * self.max_drafts
        self.successes = [r * self.prior_weight for r in rates]

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """One verify outcome: ``num_accepted`` of ``num_drafts`` drafts passed."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        verified = min(num_drafts, num_accepted + 1, self.max_drafts)
        for i in range(self.max_drafts):
            self.trials[i] *= self.decay
            self.successes[i] *= self.decay
        for i in range(verified):
            self.trials[i] += 1.0
            self.successes[i] += 1.0 if i < num_accepted else 0.0

    @property
    def conditional(self) -> list[float]:
        """``a(i)``, ``i = 1 .. max_drafts``: P(draft i accepted | drafts before it were)."""
        return [s / t for s, t in zip(self.successes, self.trials)]


class StepTimeFit:
    """Online fit ``measured ~= scale * predicted + overhead`` of whole engine steps (seconds
    from one step's start to the next's) against the profile's price of the step: an
    exponentially weighted (``decay`` per step) least-squares line, ridge-regularised
    toward ``scale = 1, overhead = 0``: the scale as strongly as ``prior_weight`` steps
    between the ``anchors`` (predicted seconds of a small and a large step: the penalty
    is ``prior_weight * min * max * (scale - 1)^2``), the overhead as weakly
    as ``overhead_weight`` steps, so that steps of one size (a steady batch) move the
    overhead and leave the scale, and a spread of sizes is needed to move the scale. A step
    measured at more than ``outlier`` times the fitted price (plus ``slack`` seconds), or
    below ``1 / outlier`` of it, is an idle gap or a hiccup and is not learned from,
    unless ``streak`` steps in a row were: then the machine changed, and it is learned.
    The overhead is never negative (a faster machine than the profile's is a scale below 1).

    ``fit.price(predicted)``: the fitted step seconds (never below ``predicted / 10``)."""

    def __init__(self, anchors: Sequence[float], prior_weight: float = 4.0,
                 overhead_weight: float = 0.1, decay: float = 0.98, outlier: float = 4.0,
                 slack: float = 0.002, streak: int = 8) -> None:
        if not anchors or any(a <= 0 for a in anchors):
            raise ValueError(f"anchors must be predicted seconds > 0, got {list(anchors)}")
        if prior_weight <= 0 or overhead_weight <= 0 or not 0 < decay <= 1 or outlier <= 1:
            raise ValueError("prior_weight > 0, overhead_weight > 0, decay in (0, 1] and "
                             "outlier > 1 needed")
        self.decay, self.outlier, self.slack, self.streak = decay, outlier, slack, streak
        self._lambda_scale = prior_weight * min(anchors) * max(anchors)
        self._lambda_overhead = overhead_weight
        self._data = [0.0] * 5  # decayed sums: w, w*p, w*p*p, w*m, w*p*m
        self.scale, self.overhead = 1.0, 0.0
        self.steps = 0  # steps learned from
        self.rejected = 0  # steps refused as outliers
        self._rejected_in_a_row = 0

    def price(self, predicted: float) -> float:
        """The fitted seconds of a step the profile prices at ``predicted``."""
        return max(self.scale * predicted + self.overhead, predicted / 10)

    def observe(self, predicted: float, measured: float) -> bool:
        """Learn from one whole step (``measured`` seconds) the profile priced at
        ``predicted``; False (nothing learned) for an outlier or a non-positive value."""
        if predicted <= 0 or measured <= 0:
            return False
        expected = self.price(predicted)
        outside = (measured > self.outlier * expected + self.slack
                   or measured < expected / self.outlier)
        if outside and self._rejected_in_a_row < self.streak:
            self.rejected += 1
            self._rejected_in_a_row += 1
            return False
        self._rejected_in_a_row = 0
        d = self._data
        for i, v in enumerate((1.0, predicted, predicted * predicted, measured,
                               predicted * measured)):
            d[i] = d[i] * self.decay + v
        self.steps += 1
        self._solve()
        return True

    def _solve(self) -> None:
        """The ridge solution: ``s (Spp + ls) + b Sp = Spm + ls`` and
        ``s Sp + b (Sw + lb) = Sm``."""
        w, p, pp, m, pm = self._data
        ls, lb = self._lambda_scale, self._lambda_overhead
        a11, a12, a22 = pp + ls, p, w + lb
        det = a11 * a22 - a12 * a12  # > 0: ls, lb > 0 and Cauchy-Schwarz
        scale = ((pm + ls) * a22 - a12 * m) / det
        overhead = (a11 * m - a12 * (pm + ls)) / det
        if scale <= 0:  # no line through positive steps: the overhead alone
            scale, overhead = 1.0, (m - p) / a22
        if overhead < 0:
            # A negative overhead prices small steps down more than large ones, so drafting
            # looks worse than the profile says; on a profile measured under heavier load than
            # serving it made the policy stop drafting for good (no drafted step, no evidence
            # to undo it). Live steps cheaper than the profile only rescale it: the ridge
            # scale with the overhead held at 0, which leaves the profile's choices as they are.
            scale, overhead = (pm + ls) / (pp + ls), 0.0
        self.scale, self.overhead = scale, overhead


class _FittedCost:
    """A :class:`StepCost` whose step prices go through a :class:`StepTimeFit`."""

    def __init__(self, cost: StepCost, fit: StepTimeFit) -> None:
        self.cost, self.fit = cost, fit

    def latency(self, profile: LatencyProfile, counts: Sequence[int],
                free: Sequence[bool] | None = None) -> float:
        return self.fit.price(self.cost.latency(profile, counts, free))


class RateGuard:
    """The measured check on the policy's choice: per batch size, the tokens per second of
    the steps that ran the drafter and of those that did not (plain steps, and steps whose
    drafts all came from prompt lookup: what a step the guard turns down still runs;
    exponentially weighted, ``decay`` per step learned), from the same wall times
    :class:`StepTimeFit` learns from. The
    priced choice can be wrong in a way the fit does not undo (its one line prices plain
    and drafting steps alike; a batch whose drafts accept less than the estimate says), and
    this is what a user sees: once both kinds have ``min_steps`` measured steps at a batch
    size, a step drafts only while drafting measures at least as fast, and the other kind
    runs every ``explore_every``-th step there to stay measured. Once drafting steps are
    measured and plain ones not yet, every ``probe_every``-th drafting step runs plain.

    ``allows(batch)``: may this step draft (the policy chose drafts)?
    ``observe(batch, drafted, tokens, seconds)``: one measured step."""

    def __init__(self, min_steps: int = 8, explore_every: int = 32, probe_every: int = 4,
                 decay: float = 0.95) -> None:
        if min_steps < 1 or explore_every < 2 or probe_every < 2 or not 0 < decay <= 1:
            raise ValueError("min_steps >= 1, explore_every >= 2, probe_every >= 2 and "
                             "decay in (0, 1] needed")
        self.min_steps, self.explore_every, self.probe_every = min_steps, explore_every, probe_every
        self.decay = decay
        # (batch size, drafted) -> [decayed tokens, decayed seconds, steps measured]
        self.rates: dict[tuple[int, bool], list[float]] = {}
        self._asked: dict[int, int] = {}  # batch size -> drafting choices seen
        self.vetoed = 0  # drafting choices turned into plain steps

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if batch <= 0 or tokens <= 0 or seconds <= 0:
            return
        row = self.rates.setdefault((batch, drafted), [0.0, 0.0, 0])
        row[0] = row[0] * self.decay + tokens
        row[1] = row[1] * self.decay + seconds
        row[2] += 1

    def rate(self, batch: int, drafted: bool) -> float | None:
        """Measured tokens per second (None: fewer than ``min_steps`` steps)."""
        row = self.rates.get((batch, drafted))
        if row is None or row[2] < self.min_steps:
            return None
        return row[0] / row[1]

    def allows(self, batch: int) -> bool:
        n = self._asked[batch] = self._asked.get(batch, 0) + 1
        drafting, plain = self.rate(batch, True), self.rate(batch, False)
        if drafting is None:  # nothing measured yet (or no tokens counted)
            allowed = True
        elif plain is None:
            allowed = n % self.probe_every != 0
        elif drafting >= plain:
            allowed = n % self.explore_every != 0
        else:
            allowed = n % self.explore_every == 0
        self.vetoed += not allowed
        return allowed

    def summary(self) -> str:
        """The measured rates, per batch size with both kinds measured."""
        parts = []
        for batch in sorted({b for b, _ in self.rates}):
            drafting, plain = self.rate(batch, True), self.rate(batch, False)
            if drafting is not None and plain is not None:
                parts.append(f"batch {batch}: {drafting:.1f} vs {plain:.1f}")
        return "; ".join(parts)


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


def _draft_pass(counts: Sequence[int], lookup: Sequence[bool]) -> bool:
    """Does a step with these draft counts run the drafter (a request drafting, not from
    prompt lookup)?"""
    return any(k > 0 and not f for k, f in zip(counts, lookup, strict=True))


class AdaptiveDrafts:
    """The per-server state of the policy: one acceptance estimate, fed by each request's
    verify outcomes, and the draft counts of every step (:func:`choose_draft_counts`).

    A drafter calls :meth:`observe` with what each request emitted this step, then
    :meth:`choose` with the requests it may draft for and their limits. With
    ``track_step_times`` (a profile the engine measured itself), the drafter also calls
    :meth:`step_started` at the same point of every engine step with the whole batch, and
    the steps are priced through a :class:`StepTimeFit` of the measured step times and the
    choices checked by a :class:`RateGuard` of the measured tokens per second.
    ``profile`` may be ``None`` until the engine has measured it (:meth:`set_profile`).
    ``draft_prior``: the drafter's acceptance per position to start from
    (:func:`measured_prior`; default 0.8 at every position)."""

    def __init__(self, max_drafts: int, profile: LatencyProfile | None, cost: StepCost,
                 log_every: int = 100, track_step_times: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 draft_prior: Sequence[float] | None = None) -> None:
        # one acceptance estimate per draft source: the method's drafter ("draft"), from
        # the checkpoint's measured acceptance where it has one (draft_prior), and prompt
        # lookup ("lookup"), whose drafts cost no draft pass
        self.estimates = {source: AcceptanceEstimate(max_drafts) for source in SOURCES}
        if draft_prior:
            self.estimates["draft"] = AcceptanceEstimate(max_drafts, prior=draft_prior)
        self.estimate = self.estimates["draft"]
        self.max_drafts = max_drafts
        self.cost = cost
        self.proposed: dict[str, int] = {}  # request id -> drafts proposed for its next step
        self.sources: dict[str, str] = {}  # request id -> where those drafts came from
        self.log_every = log_every
        self.steps = 0
        self.last_counts: list[int] = []
        self.last_lookup: list[bool] = []
        self.track_step_times = track_step_times
        self.clock = clock
        self.fit: StepTimeFit | None = None
        self.guard = RateGuard() if track_step_times else None
        # the step in flight: (its start, the whole batch's request ids, its price, whether
        # it drafts)
        self._step: tuple[float, tuple[str, ...], float, bool] | None = None
        self._batch: tuple[str, ...] = ()
        self._start = 0.0
        self.profile: LatencyProfile | None = None
        if profile is not None:
            self.set_profile(profile)

    def set_profile(self, profile: LatencyProfile) -> None:
        """Price steps from ``profile`` (and, when tracking, start a fresh step-time fit
        anchored at its AR step and its fullest step)."""
        self.profile = profile
        if self.track_step_times:
            full = self.cost.latency(profile, [self.max_drafts])
            self.fit = StepTimeFit([profile(1), max(full, profile(1) * 1.001)])

    @property
    def pricing(self) -> StepCost | _FittedCost:
        """The cost the policy prices steps with (fitted when tracking)."""
        return self.cost if self.fit is None else _FittedCost(self.cost, self.fit)

    def step_started(self, batch_req_ids: Sequence[str], emitted: int | None = None) -> None:
        """The engine started a step over ``batch_req_ids`` (every request in it, drafting
        or not; empty: a step that is not to be learned from, e.g. one with a prefill chunk
        in it). The step before ran from its own start to now and emitted ``emitted``
        tokens over the whole batch (None: not counted); it is learned from when this
        batch is the same requests (nothing joined or left in between: no prefill, no
        pause between two ``generate`` calls)."""
        if not self.track_step_times:
            return
        now = self.clock()
        batch = tuple(batch_req_ids)
        if self._step is not None and self.fit is not None:
            start, requests, predicted, drafted = self._step
            if batch and requests == batch:
                self.fit.observe(predicted, now - start)
                if self.guard is not None and emitted is not None:
                    self.guard.observe(len(batch), drafted, emitted, now - start)
        self._step = None
        self._batch = batch
        self._start = now

    def _priced(self, req_ids: Sequence[str], counts: Sequence[int],
                free: Sequence[bool]) -> None:
        """Remember the step just chosen: every request of the batch, those not drafting
        with 0 drafts."""
        if not self.track_step_times or self.profile is None or not self._batch:
            return
        chosen = dict(zip(req_ids, zip(counts, free)))
        if set(chosen) - set(self._batch):
            return
        all_counts = [chosen.get(r, (0, False)) for r in self._batch]
        price = self.cost.latency(self.profile, [k for k, _ in all_counts],
                                  [f for _, f in all_counts])
        self._step = (self._start, self._batch, price, _draft_pass(counts, free))

    def _require_profile(self) -> LatencyProfile:
        if self.profile is None:
            raise RuntimeError("measure the latency profile before the first step (the "
                               "engine does it at start-up, after its warm-up): the "
                               "adaptive policy has no latency profile yet")
        return self.profile

    def observe(self, req_id: str, num_emitted: int) -> None:
        """``num_emitted`` tokens came out of request ``req_id``'s step (accepted drafts +
        the recovered / bonus token); its drafts were the ones :meth:`choose` gave it."""
        proposed = self.proposed.pop(req_id, 0)
        source = self.sources.pop(req_id, "draft")
        if proposed > 0 and num_emitted > 0:
            self.estimates[source].update(proposed, min(num_emitted - 1, proposed))

    def choose(self, req_ids: Sequence[str], max_drafts: Sequence[int]) -> list[int]:
        """Drafts for each of ``req_ids`` this step (each at most its ``max_drafts``)."""
        return self.choose_hybrid(req_ids, max_drafts, [0] * len(req_ids))[0]

    def choose_hybrid(self, req_ids: Sequence[str], max_drafts: Sequence[int],
                      lookup_drafts: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Drafts for each of ``req_ids`` this step, and whether they are its lookup drafts
        (``lookup_drafts[r]``: how many prompt lookup found for it, 0: no match; it then
        takes at most that many) rather than the drafter's (at most ``max_drafts[r]``): the
        source the acceptance estimates favour (:meth:`_sources`)."""
        profile = self._require_profile()
        lookup = self._sources(max_drafts, lookup_drafts)
        limits = [m if f else k for k, m, f in zip(max_drafts, lookup_drafts, lookup)]
        counts = choose_draft_counts(self._acceptance(lookup), limits, profile, self.pricing,
                                     lookup)
        if _draft_pass(counts, lookup) and not self._guard_allows():
            # the guard measured the draft pass not paying here: drop the drafter's drafts
            # (a plain step for those requests), keep the lookup drafts, which cost none
            counts = [k if f else 0 for k, f in zip(counts, lookup)]
        self._record(req_ids, counts, lookup)
        return counts, lookup

    def choose_shared(self, req_ids: Sequence[str], max_drafts: Sequence[int]) -> int:
        """One draft count for the whole step (:func:`choose_shared_draft_count`); each
        request is recorded as drafting ``min(k, its max_drafts)``."""
        return self.choose_shared_hybrid(req_ids, max_drafts, [0] * len(req_ids))[0]

    def choose_shared_hybrid(self, req_ids: Sequence[str], max_drafts: Sequence[int],
                             lookup_drafts: Sequence[int]) -> tuple[int, list[bool]]:
        """:meth:`choose_shared` with prompt lookup (as :meth:`choose_hybrid`): the step's
        draft count ``k`` and each request's source; request ``r`` drafts ``min(k, its
        limit)``, its limit ``lookup_drafts[r]`` where it takes its lookup drafts."""
        profile = self._require_profile()
        lookup = self._sources(max_drafts, lookup_drafts)
        limits = [m if f else k for k, m, f in zip(max_drafts, lookup_drafts, lookup)]
        k = choose_shared_draft_count(self._acceptance(lookup), limits, profile,
                                      self.pricing, lookup)
        if _draft_pass([min(k, m) for m in limits], lookup) and not self._guard_allows():
            k = 0  # one count for all: the lookup drafts go too
        self._record(req_ids, [min(k, limit) for limit in limits], lookup)
        return k, lookup

    def _guard_allows(self) -> bool:
        """The :class:`RateGuard`'s word on a step the policy chose to draft in (always
        yes without step times, or in a step that is not measured)."""
        return self.guard is None or not self._batch or self.guard.allows(len(self._batch))

    def _acceptance(self, lookup: Sequence[bool]) -> list[list[float]]:
        by_source = {s: e.conditional for s, e in self.estimates.items()}
        return [by_source["lookup" if f else "draft"] for f in lookup]

    def _sources(self, max_drafts: Sequence[int], lookup_drafts: Sequence[int]) -> list[bool]:
        """Per request, True where its lookup drafts promise more tokens per second than
        the drafter's, each priced as a step of that request alone at its best count (a
        lookup step pays only its verify; the drafter's, a draft pass too)."""
        profile, pricing = self.profile, self.pricing
        best: dict[tuple[str, int], float] = {}

        def rate(source: str, limit: int) -> float:
            if (source, limit) not in best:
                totals = _expected_by_count(self.estimates[source].conditional, limit)
                free = [source == "lookup"]
                best[source, limit] = max(totals[k] / pricing.latency(profile, [k], free)
                                          for k in range(limit + 1))
            return best[source, limit]

        return [m > 0 and rate("lookup", m) >= rate("draft", k)
                for k, m in zip(max_drafts, lookup_drafts, strict=True)]

    def _record(self, req_ids: Sequence[str], counts: list[int], lookup: list[bool]) -> None:
        self.proposed.update(zip(req_ids, counts))
        self.sources.update((r, "lookup" if f else "draft") for r, f in zip(req_ids, lookup))
        self.steps += 1
        self.last_counts = counts
        self.last_lookup = lookup
        self._priced(req_ids, counts, lookup)

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the proposals of requests that left the batch."""
        for req_id in list(self.proposed):
            if req_id not in live_req_ids:
                del self.proposed[req_id]
        for req_id in list(self.sources):
            if req_id not in live_req_ids:
                del self.sources[req_id]

    def summary(self) -> str:
        """One log line: the last step's choice and the acceptance estimate."""
        counts = self.last_counts or [0]
        head = ", ".join(f"{a:.2f}" for a in self.estimate.conditional[:4])
        lookup = self.estimates["lookup"]
        if lookup.trials[0] > lookup.prior_weight:  # lookup drafts were verified
            head += "; of lookup drafts 1-4 " + ", ".join(
                f"{a:.2f}" for a in lookup.conditional[:4])
        fit = ("" if self.fit is None else
               f"; step time {self.fit.scale:.2f} x profile + {self.fit.overhead * 1e3:.1f} ms "
               f"({self.fit.steps} steps measured)")
        rates = "" if self.guard is None else self.guard.summary()
        if rates:
            fit += (f"; tokens/s drafting vs plain, {rates} ({self.guard.vetoed} drafting "
                    f"steps run plain)")
        return (f"adaptive drafts: batch {len(counts)}, drafts per request mean "
                f"{sum(counts) / len(counts):.1f} (min {min(counts)}, max {max(counts)}); "
                f"acceptance of drafts 1-4 {head}{fit}")
