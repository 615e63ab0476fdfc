"""The per-server policy: acceptance estimates fed by verify outcomes, and each step's
sources and draft counts (:class:`AdaptiveDrafts`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from diffspec.core.adaptive.acceptance import (
    AcceptanceEstimate,
    _expected_by_count,
    expected_tokens,
)
from diffspec.core.adaptive.calibration import RateGuard, StepTimeFit, _FittedCost
from diffspec.core.adaptive.hybrid import SOURCES, _draft_pass, seeded_draft_count
from diffspec.core.adaptive.profile import LatencyProfile, StepCost
from diffspec.core.adaptive.search import _choose_counts, choose_shared_draft_counts
from diffspec.core.carry import CARRY_SETTINGS

__all__ = ["AdaptiveDrafts"]


class AdaptiveDrafts:
    """The per-server state of the policy: acceptance estimates, fed by each request's
    verify outcomes, and the draft counts of every step (:func:`choose_draft_counts`).

    A drafter calls :meth:`observe` with what each request emitted this step, then
    :meth:`choose` with the requests it may draft for and their limits. With
    ``track_step_times`` (a profile the engine measured itself), the drafter also calls
    :meth:`step_started` at the same point of every engine step with the whole batch, and
    the steps are priced through a :class:`StepTimeFit` of the measured step times and the
    choices checked by a :class:`RateGuard` of the measured tokens per second.
    ``profile`` may be ``None`` until the engine has measured it (:meth:`set_profile`).
    ``draft_prior``: the drafter's acceptance per position to start from
    (:func:`measured_prior`; default 0.8 at every position). ``carry``: whether a two-pass
    drafter over-drafts for carried drafts (:meth:`draft_widths`): ``"auto"`` where the
    profile says it pays, ``"always"``, or ``"off"``.

    Seeded requests (``seeded``): a seeded sample must come out the same on every call,
    and the rejection sampler's draws depend on how many drafts a step verifies, so a
    seeded request's source and count are a function of its own history and the server's
    latency profile only (its own acceptance estimates, from the priors, priced as a step
    of its own on the profile, fixed for the server's life: :func:`seeded_draft_count`),
    never of the clock, the step-time fit, the guard, the server's estimates or the other
    requests; the other requests are chosen around it."""

    def __init__(self, max_drafts: int, profile: LatencyProfile | None, cost: StepCost,
                 log_every: int = 100, track_step_times: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 draft_prior: Sequence[float] | None = None, carry: str = "auto") -> None:
        # one acceptance estimate per draft source: the method's drafter ("draft"), from
        # the checkpoint's measured acceptance where it has one (draft_prior), prompt
        # lookup ("lookup", all matches; per matched n-gram length in lookup_by_n), and
        # drafts carried over from a wider block ("carry", starting from the drafter's
        # prior); lookup and carried drafts cost no draft pass
        if carry not in CARRY_SETTINGS:
            raise ValueError(f"carry is \"auto\", \"always\" or \"off\", not {carry!r}")
        self.carry = carry
        self.priors = {"draft": list(draft_prior) if draft_prior else 0.8, "lookup": 0.8}
        self.priors["carry"] = self.priors["draft"]
        self.estimates = {source: AcceptanceEstimate(max_drafts, prior=self.priors[source])
                          for source in SOURCES}
        self.estimate = self.estimates["draft"]
        self.lookup_by_n: dict[int, AcceptanceEstimate] = {}
        self.max_drafts = max_drafts
        self.cost = cost
        self.proposed: dict[str, int] = {}  # request id -> drafts proposed for its next step
        self.sources: dict[str, str] = {}  # request id -> where those drafts came from
        self.ngrams: dict[str, int] = {}  # request id -> its lookup drafts' matched n
        # seeded request id -> its own acceptance estimate per source
        self.own: dict[str, dict[str, AcceptanceEstimate]] = {}
        self.log_every = log_every
        self.steps = 0
        self.last_counts: list[int] = []
        self.last_lookup: list[bool] = []
        self.track_step_times = track_step_times
        self.clock = clock
        self.fit: StepTimeFit | None = None
        self.guard = RateGuard() if track_step_times else None
        # the same check for the steps without a draft pass: those with free drafts
        # (lookup, carried; their tokens counted) against plain ones, per batch size
        self.free_guard = RateGuard() if track_step_times else None
        # the step in flight: (its start, the whole batch's request ids, its price, whether
        # it runs the drafter, whether it verifies free drafts)
        self._step: tuple[float, tuple[str, ...], float, bool, bool] | None = None
        # the last measured step for the guards, (batch, drafted, free drafts, tokens,
        # seconds), and the free drafts accepted since the last choice (not counted for
        # the drafter's guard)
        self._guard_step: tuple[int, bool, bool, int, float] | None = None
        self._lookup_accepted = 0
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
            start, requests, predicted, drafted, free = self._step
            if batch and requests == batch:
                self.fit.observe(predicted, now - start)
                if self.guard is not None and emitted is not None:
                    # learned at the next choice, once the step's outcomes are observed
                    # (engines observe them before or after this call)
                    self._guard_step = (len(batch), drafted, free, emitted, now - start)
        self._step = None
        self._batch = batch
        self._start = now

    def _priced(self, req_ids: Sequence[str], counts: Sequence[int],
                free: Sequence[bool], widths: Sequence[int] | None = None) -> None:
        """Remember the step just chosen: every request of the batch, those not drafting
        with 0 drafts (``widths``: its draft blocks, :meth:`draft_widths`)."""
        if not self.track_step_times or self.profile is None or not self._batch:
            return
        widths = counts if widths is None else widths
        chosen = dict(zip(req_ids, zip(counts, free, widths)))
        if set(chosen) - set(self._batch):
            return
        all_counts = [chosen.get(r, (0, False, 0)) for r in self._batch]
        price = self.cost.latency(self.profile, [k for k, _, _ in all_counts],
                                  [f for _, f, _ in all_counts],
                                  [w for _, _, w in all_counts])
        self._step = (self._start, self._batch, price, _draft_pass(counts, free),
                      any(k > 0 and f for k, f in zip(counts, free)))

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
        ngram = self.ngrams.pop(req_id, 0)
        if proposed > 0 and num_emitted > 0:
            accepted = min(num_emitted - 1, proposed)
            self.estimates[source].update(proposed, accepted)
            if source != "draft":  # not the drafter's this step: left out of the guard
                self._lookup_accepted += accepted
            if source == "lookup" and ngram > 0:
                self._lookup_estimate(ngram).update(proposed, accepted)
            if req_id in self.own:
                self.own[req_id][source].update(proposed, accepted)

    def _lookup_estimate(self, ngram: int) -> AcceptanceEstimate:
        """The acceptance of lookup drafts that followed a match of ``ngram`` tokens
        (longer matches are surer); a new length starts from all lookup drafts' estimate."""
        if ngram not in self.lookup_by_n:
            self.lookup_by_n[ngram] = AcceptanceEstimate(
                self.max_drafts, prior=self.estimates["lookup"].conditional)
        return self.lookup_by_n[ngram]

    def choose(self, req_ids: Sequence[str], max_drafts: Sequence[int],
               seeded: Sequence[bool] | None = None) -> list[int]:
        """Drafts for each of ``req_ids`` this step (each at most its ``max_drafts``)."""
        return self.choose_hybrid(req_ids, max_drafts, [0] * len(req_ids), seeded=seeded)[0]

    def choose_hybrid(self, req_ids: Sequence[str], max_drafts: Sequence[int],
                      lookup_drafts: Sequence[int], lookup_ngram: Sequence[int] | None = None,
                      seeded: Sequence[bool] | None = None,
                      free_source: Sequence[str] | None = None,
                      ) -> tuple[list[int], list[bool]]:
        """Drafts for each of ``req_ids`` this step, and whether they are its lookup drafts
        (``lookup_drafts[r]``: how many prompt lookup found for it, 0: no match; it then
        takes at most that many; ``lookup_ngram[r]``: the length of the n-gram it matched;
        ``free_source[r]``: ``"carry"`` where they are drafts carried over from its last
        block, :mod:`diffspec.core.carry`, default ``"lookup"``)
        rather than the drafter's (at most ``max_drafts[r]``). The sources and counts are
        searched together, the draft pass priced once for every request that runs the
        drafter (:meth:`_search`); ``seeded[r]``: request ``r``'s source and count are its
        own history's (the class docstring), and no guard drops them."""
        profile = self._require_profile()
        self._settle_guard()
        n = len(req_ids)
        ngram = list(lookup_ngram) if lookup_ngram is not None else [0] * n
        pinned = self._pinned(req_ids, max_drafts, lookup_drafts, seeded)
        lookups = self._free_acceptance(ngram, free_source)
        counts, lookup = self._search(profile, max_drafts, lookup_drafts, lookups, pinned)
        if _draft_pass(counts, lookup) and not self._guard_allows():
            # the guard measured the draft pass not paying here: the best step without the
            # drafter (lookup drafts, which cost none, where there are some; plain steps for
            # the rest), the seeded requests' own choices kept
            counts, lookup = self._search(profile, [0] * n, lookup_drafts, lookups, pinned)
        if (not _draft_pass(counts, lookup) and any(counts)
                and not self._guard_allows(self.free_guard)):
            # free drafts measured not paying at this batch size: a plain step, the seeded
            # requests' own choices kept
            counts = [p[0] if p is not None else 0 for p in pinned]
        self._record(req_ids, counts, lookup, ngram, free_source)
        return counts, lookup

    def _free_acceptance(self, ngram: Sequence[int],
                         free_source: Sequence[str] | None) -> list[list[float]]:
        """Per request, the acceptance of its free drafts: carried drafts', or lookup
        drafts' by the n-gram length they matched (all lookup drafts' without one)."""
        free_source = free_source or ["lookup"] * len(ngram)
        return [self.estimates["carry"].conditional if s == "carry" else
                self._lookup_estimate(g).conditional if g > 0 else
                self.estimates["lookup"].conditional for g, s in zip(ngram, free_source,
                                                                     strict=True)]

    def free_drafts(self, found: Sequence[Sequence[int]], ngram: Sequence[int],
                    carried: Sequence[Sequence[int]],
                    ) -> tuple[list[list[int]], list[int], list[str]]:
        """Per request, the free drafts it is offered (``found[r]``: its lookup drafts,
        matched on ``ngram[r]`` tokens; ``carried[r]``: its carried drafts; either may be
        empty): the one promising more tokens by its source's estimate (lookup on a tie).
        Returns the drafts, their n-gram (0 for carried drafts) and their
        ``free_source`` for :meth:`choose_hybrid`."""
        drafts, ngrams, sources = [], [], []
        for f, g, c in zip(found, ngram, carried, strict=True):
            carry = bool(c) and (not f or expected_tokens(
                self.estimates["carry"].conditional, len(c)) > expected_tokens(
                self._free_acceptance([g], None)[0], len(f)))
            drafts.append(list(c) if carry else list(f))
            ngrams.append(0 if carry else g)
            sources.append("carry" if carry else "lookup")
        return drafts, ngrams, sources

    def draft_widths(self, req_ids: Sequence[str], counts: Sequence[int],
                     free: Sequence[bool], limits: Sequence[int],
                     seeded: Sequence[bool] | None = None) -> list[int]:
        """How many tokens each request's draft block drafts this step (two-pass
        drafters): its count, or, over-drafting, its limit ``limits[r]``, the drafts past
        the count kept for the next step (:mod:`diffspec.core.carry`). Over-drafting widens
        the draft pass now for a chance to skip it next step: with ``carry="auto"`` the
        drafter's blocks are widened when the draft-pass seconds each widened block is
        expected to save next step (the chance that its verified drafts and the token after
        them all match the block, times what its block adds to a draft pass, counted only
        where carried drafts beat the drafter for it, as :meth:`_sources` weighs them)
        outweigh the seconds the wider pass adds now. Never for requests drafting from
        lookup, carried drafts, or a seed (whose drafts follow their own history alone)."""
        widths = list(counts)
        seeded = seeded or [False] * len(counts)
        wide = [r for r, (k, f, m, s) in enumerate(zip(counts, free, limits, seeded,
                                                       strict=True))
                if k > 0 and not f and not s and m > k + 1]
        if self.carry == "off" or not wide or self.profile is None:
            return widths
        full = list(widths)
        for r in wide:
            full[r] = limits[r]
        if self.carry == "auto":
            profile, pricing = self.profile, self.pricing
            wider = pricing.latency(profile, counts, free, full)
            added = wider - pricing.latency(profile, counts, free, widths)
            draft, carried = self.estimates["draft"].conditional, self.estimates["carry"]
            saved = 0.0
            for r in wide:
                k, m = counts[r], limits[r]
                if not self._sources([m], [m - k - 1], [carried.conditional])[0]:
                    continue
                chance = math.prod(draft[:k + 1])
                freed = [f or i == r for i, f in enumerate(free)]
                saved += chance * (wider - pricing.latency(profile, counts, freed, full))
            if saved <= added:
                return widths
        self._priced(req_ids, counts, free, full)
        return full

    def _pinned(self, req_ids, max_drafts, lookup_drafts,
                seeded) -> list[tuple[int, bool] | None]:
        """Per request, the (count, from lookup) of a seeded one, None for the others."""
        if not seeded:
            return [None] * len(req_ids)
        profile = self._require_profile()
        pinned: list[tuple[int, bool] | None] = []
        for req_id, m, found, s in zip(req_ids, max_drafts, lookup_drafts, seeded,
                                       strict=True):
            if not s:
                pinned.append(None)
                continue
            own = self.own.setdefault(req_id, {
                source: AcceptanceEstimate(self.max_drafts, prior=self.priors[source],
                                           decay=1.0) for source in SOURCES})
            k, draft_rate = seeded_draft_count(own["draft"].conditional, m, profile,
                                               self.cost)
            j, lookup_rate = seeded_draft_count(own["lookup"].conditional, found, profile,
                                                self.cost, free=True)
            use_lookup = j > 0 and lookup_rate >= draft_rate
            pinned.append((j, True) if use_lookup else (k, False))
        return pinned

    def _search(self, profile: LatencyProfile, max_drafts: Sequence[int],
                lookup_drafts: Sequence[int], lookups: Sequence[Sequence[float]],
                pinned: Sequence[tuple[int, bool] | None]) -> tuple[list[int], list[bool]]:
        """The best (counts, sources) of a few source assignments, each scanned by
        :func:`choose_draft_counts` with the same pricing: each request's better source
        when the draft pass is paid anyway (more expected tokens at its limit; lookup on a
        tie, it adds nothing to the draft pass); each request's better source priced
        alone (:meth:`_sources`); and, by :func:`choose_draft_counts` itself, the lookup
        drafts alone with no draft pass."""
        pricing = self.pricing
        draft = self.estimates["draft"].conditional
        joint = [m > 0 and expected_tokens(acc, m) >= expected_tokens(draft, k)
                 for k, m, acc in zip(max_drafts, lookup_drafts, lookups)]
        best: tuple[float, list[int], list[bool]] | None = None
        # without a lookup match the two assignments are the same: one scan (the search
        # runs every decode step)
        alone = self._sources(max_drafts, lookup_drafts, lookups) if any(lookup_drafts) else joint
        for lookup in (joint,) if alone == joint else (joint, alone):
            lookup = [p[1] if p is not None else f for f, p in zip(lookup, pinned)]
            limits = [m if f else k for k, m, f in zip(max_drafts, lookup_drafts, lookup)]
            rate, counts = _choose_counts([acc if f else draft for f, acc in
                                           zip(lookup, lookups)], limits, profile, pricing,
                                          lookup, [p and p[0] for p in pinned])
            if best is None or rate > best[0] * (1 + 1e-9):
                best = (rate, counts, lookup)
        return best[1], best[2]

    def choose_shared(self, req_ids: Sequence[str], max_drafts: Sequence[int],
                      seeded: Sequence[bool] | None = None) -> int:
        """One draft count for the whole step (:func:`choose_shared_draft_count`); each
        request is recorded as drafting ``min(k, its max_drafts)``."""
        return self.choose_shared_hybrid(req_ids, max_drafts, [0] * len(req_ids),
                                         seeded=seeded)[0]

    def choose_shared_hybrid(self, req_ids: Sequence[str], max_drafts: Sequence[int],
                             lookup_drafts: Sequence[int],
                             lookup_ngram: Sequence[int] | None = None,
                             seeded: Sequence[bool] | None = None,
                             free_source: Sequence[str] | None = None,
                             ) -> tuple[int, list[bool], list[int]]:
        """:meth:`choose_shared` with prompt lookup (as :meth:`choose_hybrid`): the step's
        draft count ``k``, each request's source and its count: ``min(k, its limit)``, its
        limit ``lookup_drafts[r]`` where it takes its lookup drafts, or 0 where the step is
        best run with the lookup drafts alone, no draft pass
        (:func:`choose_shared_draft_counts`). A step with a seeded request in it takes the
        count of the drafter's prior on the profile (:func:`seeded_draft_count` over the
        widest limit), the same for every seeded request whatever the batch: one ``k`` for
        all can follow no one request's history."""
        profile = self._require_profile()
        self._settle_guard()
        n = len(req_ids)
        ngram = list(lookup_ngram) if lookup_ngram is not None else [0] * n
        lookups = self._free_acceptance(ngram, free_source)
        lookup = self._sources(max_drafts, lookup_drafts, lookups)
        limits = [m if f else k for k, m, f in zip(max_drafts, lookup_drafts, lookup)]
        if seeded and any(seeded):
            lookup = [m > 0 for m in lookup_drafts]
            limits = [m if f else k for k, m, f in zip(max_drafts, lookup_drafts, lookup)]
            prior = AcceptanceEstimate(self.max_drafts, prior=self.priors["draft"])
            k = seeded_draft_count(prior.conditional, max(limits, default=0), profile,
                                   self.cost)[0]
            counts = [min(k, limit) for limit in limits]
        else:
            draft = self.estimates["draft"].conditional
            k, counts = choose_shared_draft_counts(
                [acc if f else draft for f, acc in zip(lookup, lookups)], limits, profile,
                self.pricing, lookup)
            if _draft_pass(counts, lookup) and not self._guard_allows():
                k, counts = 0, [0] * n  # one count for all: the lookup drafts go too
            elif (not _draft_pass(counts, lookup) and any(counts)
                  and not self._guard_allows(self.free_guard)):
                k, counts = 0, [0] * n  # free drafts measured not paying here
        self._record(req_ids, counts, lookup, ngram, free_source)
        return k, lookup, counts

    def _settle_guard(self) -> None:
        """Give the guards the last measured step: the drafter's, less the free drafts it
        accepted; the free drafts', a step without a draft pass, every token counted."""
        if self._guard_step is not None and self.guard is not None:
            batch, drafted, free, emitted, seconds = self._guard_step
            self.guard.observe(batch, drafted, emitted - self._lookup_accepted, seconds)
            if not drafted and self.free_guard is not None:
                self.free_guard.observe(batch, free, emitted, seconds)
        self._guard_step = None
        self._lookup_accepted = 0

    def _guard_allows(self, guard: RateGuard | None = None) -> bool:
        """A :class:`RateGuard`'s word (default the drafter's; :attr:`free_guard` for a
        step of free drafts alone) on a step the policy chose to draft in (always yes
        without step times, or in a step that is not measured)."""
        guard = self.guard if guard is None else guard
        return guard is None or not self._batch or guard.allows(len(self._batch))

    def _sources(self, max_drafts: Sequence[int], lookup_drafts: Sequence[int],
                 lookups: Sequence[Sequence[float]] | None = None) -> list[bool]:
        """Per request, True where its lookup drafts promise more tokens per second than
        the drafter's, each priced as a step of that request alone at its best count (a
        lookup step pays only its verify; the drafter's, a draft pass too).
        ``lookups[r]``: the acceptance of request ``r``'s lookup drafts (default: all
        lookup drafts')."""
        profile, pricing = self.profile, self.pricing
        best: dict[tuple[str, int], float] = {}
        pooled = self.estimates["lookup"].conditional
        lookups = lookups if lookups is not None else [pooled] * len(max_drafts)

        def rate(acceptance: Sequence[float], free: bool, limit: int) -> float:
            key = (id(acceptance), limit)
            if key not in best:
                totals = _expected_by_count(acceptance, limit)
                best[key] = max(totals[k] / pricing.latency(profile, [k], [free])
                                for k in range(limit + 1))
            return best[key]

        draft = self.estimates["draft"].conditional
        return [m > 0 and rate(acc, True, m) >= rate(draft, False, k)
                for k, m, acc in zip(max_drafts, lookup_drafts, lookups, strict=True)]

    def _record(self, req_ids: Sequence[str], counts: list[int], lookup: list[bool],
                ngram: Sequence[int] | None = None,
                free_source: Sequence[str] | None = None) -> None:
        ngram = ngram if ngram is not None else [0] * len(req_ids)
        free_source = free_source or ["lookup"] * len(req_ids)
        self.proposed.update(zip(req_ids, counts))
        self.sources.update((r, s if f else "draft")
                            for r, f, s in zip(req_ids, lookup, free_source))
        self.ngrams.update((r, g if f and s == "lookup" else 0)
                           for r, f, g, s in zip(req_ids, lookup, ngram, free_source))
        self.steps += 1
        self.last_counts = counts
        self.last_lookup = lookup
        self._priced(req_ids, counts, lookup)

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the state of requests that left the batch."""
        for table in (self.proposed, self.sources, self.ngrams, self.own):
            for req_id in [r for r in table if r not in live_req_ids]:
                del table[req_id]

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
        free = "" if self.free_guard is None else self.free_guard.summary()
        if free:
            fit += (f"; tokens/s of free drafts alone vs plain, {free} "
                    f"({self.free_guard.vetoed} steps run plain)")
        return (f"adaptive drafts: batch {len(counts)}, drafts per request mean "
                f"{sum(counts) / len(counts):.1f} (min {min(counts)}, max {max(counts)}); "
                f"acceptance of drafts 1-4 {head}{fit}")
