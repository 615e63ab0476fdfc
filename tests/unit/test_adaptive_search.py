"""The adaptive policy's search and measurements on hand-built cases (issue 47, items 1-3
and 5; seeded requests, issue 45): the draft pass priced once for the whole step, lookup
steps kept out of the guard's plain rate, lookup acceptance by matched n-gram length,
SGLang's padded steps, and seeded requests drafted by their own history alone."""

from __future__ import annotations

import itertools
import random

import pytest

from diffspec.core.adaptive import (
    AdaptiveDrafts,
    LatencyProfile,
    StepCost,
    choose_draft_counts,
    choose_shared_draft_count,
    choose_shared_draft_counts,
    expected_tokens,
    seeded_draft_count,
)
from tests.unit.clock import Clock

TWO_PASS = StepCost("two_pass")
# a CPU-like profile: a draft pass and a verify of a few tokens each cost about a step
MS_PROFILE = LatencyProfile({1: 0.050, 8: 0.060, 16: 0.085, 32: 0.145})


def _rate(acceptance, counts, free, profile=MS_PROFILE, cost=TWO_PASS) -> float:
    tokens = sum(expected_tokens(acc, k) for acc, k in zip(acceptance, counts))
    return tokens / cost.latency(profile, counts, free)


def test_lookup_drafts_alone_when_the_draft_pass_does_not_pay() -> None:
    """Request 0 on lookup (acceptance 0.6, no draft pass), request 1 on the drafter
    (0.5): the drafter's first gain (0.5) outranks lookup's later ones, and a scan in gain
    order commits to the draft pass at [1, 1] and never returns; the best step is lookup
    alone, [4, 0] (57.8 tokens/s), as an exhaustive search finds."""
    acceptance, free = [[0.6] * 7, [0.5] * 7], [True, False]
    counts = choose_draft_counts(acceptance, [7, 7], MS_PROFILE, TWO_PASS, free)
    exhaustive = max(itertools.product(range(8), repeat=2),
                     key=lambda c: _rate(acceptance, c, free))
    assert counts == list(exhaustive) == [4, 0]
    assert _rate(acceptance, counts, free) == pytest.approx(57.848, abs=1e-3)


def test_the_search_is_never_worse_than_either_scan() -> None:
    """On random small steps (lookup and drafter requests, CPU-like profiles) the choice
    is at least as fast as the scan over every draft and the lookup drafts' scan alone,
    and within 10% of exhaustive search."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 3)
        acceptance = [[rng.uniform(0.1, 0.95)] * 4 for _ in range(n)]
        free = [rng.random() < 0.5 for _ in range(n)]
        base = rng.uniform(0.01, 0.05)
        profile = LatencyProfile({1: base, 8: base * rng.uniform(1.0, 1.5),
                                  32: base * rng.uniform(1.5, 4.0)})
        counts = choose_draft_counts(acceptance, [4] * n, profile, TWO_PASS, free)
        rate = _rate(acceptance, counts, free, profile)
        only_free = choose_draft_counts(acceptance, [4 if f else 0 for f in free], profile,
                                        TWO_PASS, free)
        assert rate >= _rate(acceptance, only_free, free, profile) * (1 - 1e-9)
        best = max(_rate(acceptance, c, free, profile)
                   for c in itertools.product(range(5), repeat=n))
        assert rate >= 0.9 * best


def test_the_shared_count_weighs_the_lookup_drafts_alone() -> None:
    """One count for the step (SGLang's verify width): with the drafter's request drafting
    ``k`` too, every ``k`` pays a draft pass; the lookup request alone at ``k`` pays none.
    Every ``k`` with both drafting is slower than a plain step here, so the old choice
    (``choose_shared_draft_count``) is a plain step (38.9 tokens/s); lookup alone at 4
    drafts makes 57.8."""
    acceptance, free = [[0.6] * 7, [0.5] * 7], [True, False]
    both = choose_shared_draft_count(acceptance, [7, 7], MS_PROFILE, TWO_PASS, free)
    k, counts = choose_shared_draft_counts(acceptance, [7, 7], MS_PROFILE, TWO_PASS, free)
    assert both == 0 and counts == [4, 0] and k == 4
    assert _rate(acceptance, counts, free) == pytest.approx(57.848, abs=1e-3)
    assert _rate(acceptance, [0, 0], free) == pytest.approx(38.889, abs=1e-3)


def _policy(draft: float, lookup: float, profile=MS_PROFILE, **kwargs) -> AdaptiveDrafts:
    policy = AdaptiveDrafts(7, profile, TWO_PASS, **kwargs)
    policy.estimates["draft"] = policy.estimate = _estimate(draft)
    policy.estimates["lookup"] = _estimate(lookup)
    return policy


def _estimate(rate: float):
    from diffspec.core.adaptive import AcceptanceEstimate

    return AcceptanceEstimate(7, prior=rate, prior_weight=1e6)


def test_a_request_joins_the_draft_pass_another_request_pays_for() -> None:
    """Request "b" needs the drafter (no lookup match) and pays the draft pass. Request
    "a" has a lookup match that beats its drafter only when its drafter would pay the
    pass alone (how the source used to be chosen, each request priced alone); with the
    pass paid by "b", "a"'s drafter drafts are worth more, and the step chooses them."""
    flat = LatencyProfile({1: 0.05, 64: 0.05})  # a draft pass and a verify: 50 ms each
    policy = _policy(draft=0.9, lookup=0.8, profile=flat)
    alone = policy._sources([7, 7], [4, 0])
    assert alone == [True, False]  # priced alone, "a" would take its lookup drafts
    counts, lookup = policy.choose_hybrid(["a", "b"], [7, 7], [4, 0])
    assert lookup == [False, False] and counts == [7, 7]
    draft, looked = [0.9] * 7, [0.8] * 7
    alone_counts = choose_draft_counts([looked, draft], [4, 7], flat, TWO_PASS,
                                       [True, False])
    assert _rate([draft, draft], counts, [False, False], flat) > 1.2 * _rate(
        [looked, draft], alone_counts, [True, False], flat)


def test_lookup_acceptance_is_rated_by_matched_ngram_length() -> None:
    """Lookup drafts after a 4-token match are accepted, after a 2-token match rejected:
    the policy learns the two apart and takes lookup drafts for the long match only."""
    policy = _policy(draft=0.5, lookup=0.5)
    for step in range(200):
        ids = [f"long{step}", f"short{step}"]
        counts, lookup = policy.choose_hybrid(ids, [7, 7], [4, 4], [4, 2])
        for req, k, f, n in zip(ids, counts, lookup, (4, 2)):
            emitted = 1 + (k if f and n == 4 else 0)
            policy.observe(req, emitted)
    assert policy.lookup_by_n[4].conditional[0] > 0.9
    if 2 in policy.lookup_by_n:
        assert policy.lookup_by_n[2].conditional[0] < 0.5
    counts, lookup = policy.choose_hybrid(["x", "y"], [7, 7], [4, 4], [4, 2])
    assert lookup == [True, False]


def test_lookup_steps_do_not_lift_the_guards_plain_rate() -> None:
    """One request whose text turns repetitive every other 10 steps (lookup drafts, all
    accepted, in a fast step). Drafter steps measure 2 tokens in 15 ms (133 tokens/s),
    plain steps 1 in 10 ms (100/s). Counted with the plain steps, the lookup steps
    (5 tokens in 12 ms) would make plain look faster than drafting and the guard would
    stop the drafter; counted without their lookup tokens they do not, and the drafter
    keeps drafting on the plain text."""
    clock = Clock(100.0)
    flat = LatencyProfile({1: 0.010, 64: 0.011})
    policy = AdaptiveDrafts(7, flat, TWO_PASS, track_step_times=True, clock=clock)
    emitted, drafter_steps = None, []
    for step in range(400):
        repetitive = (step // 10) % 2 == 0
        policy.step_started(["a"], emitted)
        counts, lookup = policy.choose_hybrid(["a"], [7], [4 if repetitive else 0], [3])
        k = counts[0]
        if k and lookup[0]:
            emitted, seconds = 1 + k, 0.012
        elif k:
            emitted, seconds = 2, 0.015
        else:
            emitted, seconds = 1, 0.010
        policy.observe("a", emitted)
        clock.now += seconds
        if not repetitive and step >= 200:
            drafter_steps.append(k > 0)
    plain = policy.guard.rate(1, False)
    assert plain is not None and plain < 110  # about 100 tokens/s: no lookup tokens in it
    assert sum(drafter_steps) >= 0.8 * len(drafter_steps)


def test_sglang_prices_its_padded_steps() -> None:
    """SGLang's step has one width: a request drafting 3 beside one drafting none verifies
    two blocks of 4, and the draft pass runs over both (8 tokens); priced unpadded it was
    4 + 5 tokens."""
    profile = LatencyProfile({1: 1.0, 100: 100.0})  # 1 s per token
    padded = StepCost("two_pass", padded=True)
    assert padded.latency(profile, [3, 0], [False, False]) == pytest.approx(8 + 8)
    assert TWO_PASS.latency(profile, [3, 0], [False, False]) == pytest.approx(4 + 5)
    # a lookup-only step: no draft pass, the verify still padded
    assert padded.latency(profile, [3, 0], [True, False]) == pytest.approx(8)

    from types import SimpleNamespace

    from diffspec.spec_workers.sglang.policy import adaptive_policy

    config = SimpleNamespace(diffspec={"adaptive": True})
    assert adaptive_policy(config, 7, "two_pass").cost.padded
    assert not adaptive_policy(config, 7, "quadratic", "tidar").cost.padded
    # SGLang honours seeds only under deterministic inference: there, a fixed count
    assert adaptive_policy(config, 7, "two_pass", deterministic=True) is None


def test_a_seeded_requests_drafts_follow_its_own_history_only() -> None:
    """The same seeded request, with the same outcomes, gets the same sources and counts
    whatever else happens on the same profile: a step-time fit and guard fed other times,
    other requests in the batch, and the server's estimates moved by them. Unseeded, the
    same request's counts move with them."""
    def run(others: int, seeded: bool, rate: float, seed: int) -> list[tuple[int, bool]]:
        clock = Clock(100.0)
        policy = AdaptiveDrafts(7, MS_PROFILE, TWO_PASS, track_step_times=True, clock=clock,
                                draft_prior=[0.9, 0.6, 0.4])
        choices, rng = [], random.Random(seed)
        batch = ["s", *(f"o{i}" for i in range(others))]
        emitted = None
        for step in range(60):
            policy.step_started(batch, emitted)
            lookup_found = [3 if step % 7 == 0 else 0] + [2] * others
            counts, lookup = policy.choose_hybrid(batch, [7] * len(batch), lookup_found,
                                                  [2] * len(batch),
                                                  [seeded] + [False] * others)
            choices.append((counts[0], lookup[0]))
            outcome = [1 + min(counts[0], step % 3)]  # the seeded request's own history
            outcome += [1 + int(rng.random() < rate) * counts[i] for i in range(1, len(batch))]
            for req, e in zip(batch, outcome):
                policy.observe(req, e)
            emitted = sum(outcome)
            clock.now += rng.uniform(0.01, 0.2)
        return choices

    seeded = [run(others, True, rate, seed) for others, rate, seed in
              ((0, 0.9, 1), (3, 0.1, 2), (2, 0.5, 3))]
    assert seeded[0] == seeded[1] == seeded[2]
    assert any(k > 0 for k, _ in seeded[0]) and any(f for _, f in seeded[0])
    unseeded = [run(others, False, rate, seed) for others, rate, seed in
                ((0, 0.9, 1), (3, 0.1, 2))]
    assert unseeded[0] != unseeded[1]


def test_the_seeded_count_is_the_requests_best_alone_on_the_profile() -> None:
    """A seeded request's count: the best for it alone on the profile, by its acceptance;
    none where drafting never pays on it (a profile where every token costs the same)."""
    k, rate = seeded_draft_count([0.9, 0.6, 0.4, 0.4], 7, MS_PROFILE, TWO_PASS)
    assert k == max(range(8), key=lambda j: _rate([[0.9, 0.6, 0.4, 0.4]], [j], [False]))
    assert rate == pytest.approx(_rate([[0.9, 0.6, 0.4, 0.4]], [k], [False]))
    linear = LatencyProfile({1: 0.001, 1000: 1.0})
    assert seeded_draft_count([0.9] * 7, 7, linear, TWO_PASS)[0] == 0
    assert seeded_draft_count([0.9] * 7, 0, MS_PROFILE, TWO_PASS) == (0, pytest.approx(20.0))


def test_a_step_with_a_seeded_request_takes_the_priors_count() -> None:
    """One count per step (SGLang, TiDAR): a seeded request in the step fixes it at the
    drafter prior's best count on the profile, whatever the others; lookup requests at most
    their match."""
    flat = LatencyProfile({1: 0.01, 64: 0.0101})
    policy = _policy(draft=0.2, lookup=0.2, profile=flat)
    policy.priors["draft"] = [0.9] * 7
    k, lookup, counts = policy.choose_shared_hybrid(["s", "o"], [5, 3], [0, 2],
                                                    seeded=[True, False])
    assert k == 5 and counts == [5, 2] and lookup == [False, True]
    dear = LatencyProfile({1: 0.001, 1000: 1.0})
    policy = _policy(draft=0.9, lookup=0.2, profile=dear)
    assert policy.choose_shared_hybrid(["s"], [4], [0], seeded=[True])[2] == [0]
