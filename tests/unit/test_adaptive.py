"""The adaptive draft-length policy on hand-built latency profiles and acceptance rates:
it drafts nothing where drafting cannot pay, the full block where it is free, and moves
between the two with the load."""

from __future__ import annotations

import pytest

from diffspec.core.adaptive import (
    AcceptanceEstimate,
    LatencyProfile,
    StepCost,
    choose_draft_counts,
    expected_tokens,
)

LINEAR, TWO_PASS, QUADRATIC = StepCost("linear"), StepCost("two_pass"), StepCost("quadratic")
# memory-bound up to 64 query tokens (flat), compute-bound past it (linear)
ROOFLINE = LatencyProfile({1: 0.010, 64: 0.010, 128: 0.020, 1024: 0.160})


def test_latency_profile_interpolates_and_extrapolates() -> None:
    profile = LatencyProfile({1: 1.0, 8: 1.0, 16: 3.0})
    assert profile(0) == 0.0
    assert profile(4) == 1.0
    assert profile(12) == pytest.approx(2.0)
    assert profile(32) == pytest.approx(7.0)  # the last segment's line, extended
    with pytest.raises(ValueError):
        LatencyProfile({})


def test_expected_tokens() -> None:
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([1.0], 3) == 2.0  # positions past the estimate never accept


def test_the_full_block_where_drafting_is_free() -> None:
    flat = LatencyProfile({1: 0.01, 4096: 0.01})
    for cost in (LINEAR, QUADRATIC):
        assert choose_draft_counts([[0.6] * 7] * 3, [7, 7, 7], flat, cost) == [7, 7, 7]


def test_nothing_where_drafting_cannot_pay() -> None:
    # every query token costs the same (compute-bound): k drafts cost k + 1 tokens' time
    # and commit fewer than k + 1 tokens unless every draft is accepted
    compute = LatencyProfile({1: 0.001, 1000: 1.0})
    assert choose_draft_counts([[0.9] * 7] * 4, [7] * 4, compute, LINEAR) == [0, 0, 0, 0]
    # drafts that are never accepted are never worth a token, even when tokens are free
    flat = LatencyProfile({1: 0.01, 4096: 0.01})
    assert choose_draft_counts([[0.0] * 7] * 2, [7, 7], flat, LINEAR) == [0, 0]
    # Orthrus: the draft forward has a fixed cost; weak drafts do not pay for it
    assert choose_draft_counts([[0.2] * 7], [7], flat, TWO_PASS) == [0]
    assert choose_draft_counts([[0.95] * 7], [7], flat, TWO_PASS) == [7]


def test_it_drafts_less_as_the_batch_grows() -> None:
    acceptance = [0.8] * 15
    per_request = []
    for batch in (1, 4, 16, 64, 256):
        counts = choose_draft_counts([acceptance] * batch, [15] * batch, ROOFLINE, LINEAR)
        assert len(set(counts)) <= 2  # the same rates: counts differ by the tie order only
        per_request.append(sum(counts) / batch)
    assert per_request[0] == 15  # one request: 16 tokens are inside the flat part
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[-1] == 0  # 256 requests: already compute-bound without drafts


def test_better_requests_draft_more() -> None:
    counts = choose_draft_counts([[0.95] * 15, [0.3] * 15], [15, 15],
                                 LatencyProfile({1: 0.01, 16: 0.01, 32: 0.03}), LINEAR)
    assert counts[0] > counts[1]


def test_limits_per_request_are_kept() -> None:
    flat = LatencyProfile({1: 0.01, 4096: 0.01})
    assert choose_draft_counts([[0.9] * 7] * 3, [7, 2, 0], flat, LINEAR) == [7, 2, 0]
    assert choose_draft_counts([], [], flat, LINEAR) == []


def test_quadratic_cost_counts_the_branches() -> None:
    # TiDAR with k drafts forwards (k + 1)(1 + k) tokens: the flat region of 64 tokens fits
    # k = 7 for one request (64 tokens) but not k = 8 (81)
    counts = choose_draft_counts([[0.99] * 15], [15], ROOFLINE, QUADRATIC)
    assert counts == [7]


def test_acceptance_estimate_learns_the_rates() -> None:
    estimate = AcceptanceEstimate(max_drafts=3, prior=0.8, prior_weight=1.0, decay=1.0)
    for _ in range(1000):  # draft 1 always passes, draft 2 half the time, draft 3 never
        estimate.update(3, 1)
        estimate.update(3, 2)
    a = estimate.conditional
    assert a[0] == pytest.approx(1.0, abs=0.001)
    assert a[1] == pytest.approx(0.5, abs=0.001)
    assert a[2] == pytest.approx(0.0, abs=0.001)
    with pytest.raises(ValueError):
        estimate.update(2, 3)


def test_acceptance_estimate_forgets() -> None:
    estimate = AcceptanceEstimate(max_drafts=1, prior_weight=1.0, decay=0.99)
    for _ in range(2000):
        estimate.update(1, 1)
    for _ in range(2000):
        estimate.update(1, 0)
    assert estimate.conditional[0] < 0.05


def test_load_latency_profile_reads_both_formats() -> None:
    from diffspec.core.adaptive import load_latency_profile

    assert load_latency_profile({"points": {"1": 0.5, "8": 1.0}})(8) == 1.0
    profiler = {"latency_s": {"256": {"1": 0.1, "8": 0.2}, "4096": {"1": 0.3, "8": 0.6}}}
    assert load_latency_profile(profiler)(8) == 0.2  # the smallest context by default
    assert load_latency_profile(profiler, context=3000)(8) == 0.6
    with pytest.raises(ValueError):
        load_latency_profile({"nothing": 1})


def test_adaptive_drafts_learns_from_outcomes_and_backs_off() -> None:
    from diffspec.core.adaptive import AdaptiveDrafts

    # every extra token costs a little: drafting pays only while acceptance is high
    policy = AdaptiveDrafts(7, LatencyProfile({1: 0.010, 2: 0.011, 16: 0.030}), LINEAR)
    assert min(policy.choose(["a", "b"], [7, 7])) > 0  # optimistic prior: draft
    for _ in range(300):  # every draft rejected, for both requests
        for req in ("a", "b"):
            policy.observe(req, 1)
        policy.choose(["a", "b"], [7, 7])
    assert policy.last_counts == [0, 0]
    assert policy.estimate.conditional[0] < 0.3  # frozen once it stops drafting
    policy.forget({"a"})
    assert set(policy.proposed) <= {"a"}
    assert "batch 2" in policy.summary()


@pytest.mark.parametrize(
    ("per_position", "conditional"),
    [
        ([0.9, 0.45, 0.09], [0.9, 0.5, 0.2]),  # vLLM's counts: non-increasing shares
        ([0.5, 0.0, 0.0], [0.5, 0.0, 0.0]),  # never reached past the first draft
        ([0.0, 0.0], [0.0, 0.0]),
        ([1.2, 0.6], [1.0, 0.6]),  # clamped to [0, 1]
        ([], []),
    ],
    ids=["decaying", "stops", "none_accepted", "clamped", "empty"],
)
def test_conditional_acceptance(per_position, conditional) -> None:
    from diffspec.core.adaptive import conditional_acceptance

    assert conditional_acceptance(per_position) == pytest.approx(conditional)
    # the expected tokens are the per-position shares summed, whichever form is used
    assert expected_tokens(conditional, len(per_position)) == pytest.approx(
        1 + sum(min(p, 1.0) for p in per_position))


def test_one_shared_count_per_step() -> None:
    from diffspec.core.adaptive import AdaptiveDrafts, choose_shared_draft_count

    flat = LatencyProfile({1: 0.01, 4096: 0.01})
    compute = LatencyProfile({1: 0.001, 1000: 1.0})
    assert choose_shared_draft_count([[0.6] * 7] * 3, [7] * 3, flat, TWO_PASS) == 7
    assert choose_shared_draft_count([[0.9] * 7] * 4, [7] * 4, compute, TWO_PASS) == 0
    assert choose_shared_draft_count([[0.2] * 7], [7], flat, TWO_PASS) == 0
    assert choose_shared_draft_count([], [], flat, TWO_PASS) == 0
    # per-request limits cap what a request drafts, not the step's width
    assert choose_shared_draft_count([[0.9] * 7] * 2, [2, 7], flat, TWO_PASS) == 7
    shared = [choose_shared_draft_count([[0.8] * 15] * b, [15] * b, ROOFLINE, LINEAR)
              for b in (1, 4, 16, 64, 256)]
    assert shared[0] == 15 and shared[-1] == 0 and shared == sorted(shared, reverse=True)
    policy = AdaptiveDrafts(7, flat, TWO_PASS)
    assert policy.choose_shared(["a", "b"], [7, 3]) == 7
    assert policy.proposed == {"a": 7, "b": 3} and policy.last_counts == [7, 3]


def test_draft_passes_priced_from_their_own_table() -> None:
    """An engine whose draft pass costs more than a forward of as many tokens (SGLang's
    draft copies each request's prefix K/V) drafts less: the two-pass step is priced with
    ``draft_points`` where the profile has them."""
    from diffspec.core.adaptive import load_latency_profile

    flat = {1: 0.010, 4: 0.010}
    cheap = LatencyProfile(flat)
    dear = load_latency_profile({"points": {str(t): s for t, s in flat.items()},
                                 "draft_points": {"4": 0.040}})
    assert dear.draft(4) == 0.040 and dear(4) == 0.010 and cheap.draft(4) == 0.010
    assert dear.draft(0) == 0.0
    assert TWO_PASS.latency(dear, [3]) == pytest.approx(0.050)
    assert TWO_PASS.latency(dear, [0]) == pytest.approx(0.010)  # no draft pass at all
    acceptance = [[0.9, 0.8, 0.7]]
    assert choose_draft_counts(acceptance, [3], cheap, TWO_PASS) == [3]
    assert choose_draft_counts(acceptance, [3], dear, TWO_PASS) == [0]
    with pytest.raises(ValueError, match="draft_points"):
        LatencyProfile(flat, {4: 0.0})


def test_a_dear_verify_is_priced_too() -> None:
    """A verify forward measured dearer than a plain step of as many tokens (SGLang's
    torch-native verify) prices drafting steps; steps that draft nothing stay plain."""
    from diffspec.core.adaptive import load_latency_profile

    profile = load_latency_profile({"points": {"1": 0.010, "4": 0.010},
                                    "verify_points": {"2": 0.030, "4": 0.030}})
    assert profile.verify(4) == 0.030 and profile(4) == 0.010
    assert LatencyProfile({1: 0.02}, verify_points={1: 0.01}).verify(1) == 0.02  # never less
    assert TWO_PASS.latency(profile, [3]) == pytest.approx(0.040)
    assert TWO_PASS.latency(profile, [0]) == pytest.approx(0.010)
    assert choose_draft_counts([[0.9, 0.8, 0.7]], [3], profile, TWO_PASS) == [0]
    assert choose_draft_counts([[0.9, 0.8, 0.7]], [3], LatencyProfile({1: 0.010, 4: 0.010}),
                               TWO_PASS) == [3]


def test_a_measured_prior_starts_the_estimate_per_position() -> None:
    from diffspec.core.adaptive import checkpoint_prior, measured_prior

    # the shipped heads' vLLM counters (share of steps with drafts 1..j all accepted)
    prior = measured_prior([0.892, 0.394, 0.077, 0.016, 0.002, 0.0, 0.0])
    assert prior[:4] == pytest.approx([0.892, 0.4417, 0.1954, 0.2078], abs=1e-3)
    assert prior[5:] == [0.05, 0.05]  # never reached: kept triable, not ruled out
    assert measured_prior([1.0]) == [0.95]  # nor taken as certain
    assert measured_prior(None) is None and measured_prior("0.9") is None
    assert measured_prior(["x"]) is None
    assert checkpoint_prior({"diffspec_draft_acceptance": [0.5]}) == [0.5]
    assert checkpoint_prior(type("Config", (), {})()) is None

    estimate = AcceptanceEstimate(max_drafts=4, prior=[0.9, 0.4], prior_weight=2.0, decay=1.0)
    assert estimate.conditional == pytest.approx([0.9, 0.4, 0.4, 0.4])  # the last rate on
    estimate.update(2, 2)  # positions 1 and 2 pass; 3 is not verified
    assert estimate.conditional == pytest.approx([(1.8 + 1) / 3, (0.8 + 1) / 3, 0.4, 0.4])
    with pytest.raises(ValueError):
        AcceptanceEstimate(max_drafts=2, prior=[0.5, 1.5])
    with pytest.raises(ValueError):
        AcceptanceEstimate(max_drafts=2, prior=[])


def test_a_fresh_policy_drafts_what_the_measured_prior_pays_for() -> None:
    from diffspec.core.adaptive import AdaptiveDrafts, measured_prior

    # a draft pass and a verify pass each cost about one AR step (a small model on a CPU)
    profile = LatencyProfile({1: 0.030, 8: 0.034, 64: 0.080})
    optimistic = AdaptiveDrafts(7, profile, TWO_PASS)
    measured = AdaptiveDrafts(7, profile, TWO_PASS,
                              draft_prior=measured_prior([0.892, 0.394, 0.077, 0.016]))
    (wide,), (narrow,) = optimistic.choose(["a"], [7]), measured.choose(["a"], [7])
    assert wide >= 5  # 0.8 at every position: the full block looks worth it
    assert 1 <= narrow <= 3  # drafts 4.. pass in under 2% of steps: not drafted
    assert measured.estimates["lookup"].conditional[0] == pytest.approx(0.8)  # lookup's own
