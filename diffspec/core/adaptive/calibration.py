"""Calibration against the live engine: the online fit of measured step times to the
profile's prices, and the rate guard of measured tokens per second."""

from __future__ import annotations

from collections.abc import Sequence

from diffspec.core.adaptive.profile import LatencyProfile, StepCost

__all__ = ["RateGuard", "StepTimeFit"]


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

    @property
    def padded(self) -> bool:
        return self.cost.padded

    def latency(self, profile: LatencyProfile, counts: Sequence[int],
                free: Sequence[bool] | None = None,
                widths: Sequence[int] | None = None) -> float:
        return self.fit.price(self.cost.latency(profile, counts, free, widths))


class RateGuard:
    """The measured check on the policy's choice: per batch size, the tokens per second of
    the steps that ran the drafter and of those that did not (plain steps, and steps whose
    drafts all came from prompt lookup: what a step the guard turns down still runs), not
    counting the tokens of lookup drafts in either (:class:`AdaptiveDrafts` leaves them
    out: lookup drafts come on repetitive text, and counted they would lift the steps
    without a draft pass above the drafter's for the text, not the step; exponentially
    weighted, ``decay`` per step learned), from the same wall times
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
        """One measured step: ``drafted``, it ran the drafter; ``tokens``, what it
        committed (the policy counts no tokens of prompt lookup's here: they come on
        repetitive text whichever kind the step is)."""
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
