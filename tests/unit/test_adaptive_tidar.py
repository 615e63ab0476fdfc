"""The adaptive draft-count policy priced for TiDAR / NLD quadratic steps (``StepCost
("quadratic", skip)``) on hand-built latency profiles: a step with ``k`` drafts forwards the
verify chain and ``k + 1`` branches of ``k + skip`` masks per request, in one forward timed
by the drafter (``verify_points``); nothing drafted is a plain AR step."""

from __future__ import annotations

import pytest

from diffspec.core.adaptive import (
    AdaptiveDrafts,
    LatencyProfile,
    StepCost,
    choose_draft_counts,
    choose_shared_draft_count,
    load_latency_profile,
)

SHIFTED, UNSHIFTED = StepCost("quadratic"), StepCost("quadratic", skip=1)
PER_TOKEN = LatencyProfile({1: 1.0, 1000: 1000.0})  # seconds = query tokens
FREE = LatencyProfile({1: 0.01, 4096: 0.01})
# flat up to 12 query tokens, then every token costs 9 times a whole flat step (the engine
# tests' profile)
KNEE = LatencyProfile({1: 0.01, 12: 0.01, 13: 0.1})


@pytest.mark.parametrize(
    ("cost", "counts", "tokens"),
    [
        (SHIFTED, [3], 16),  # [t0, d1..d3] + 4 branches of 3 masks
        (UNSHIFTED, [3], 20),  # + 4 branches of 4 masks (the first sits on the bonus token)
        (SHIFTED, [0], 1),  # plain AR step
        (UNSHIFTED, [0, 0], 2),
        (SHIFTED, [1, 0, 2], 4 + 1 + 9),  # per request, summed into one forward
    ],
    ids=["shifted", "unshifted", "ar", "ar_batch", "mixed"],
)
def test_step_tokens(cost: StepCost, counts: list[int], tokens: int) -> None:
    assert cost.latency(PER_TOKEN, counts) == pytest.approx(tokens)


def test_the_full_block_where_drafting_is_free() -> None:
    for cost, block in ((SHIFTED, 8), (UNSHIFTED, 7)):
        assert choose_draft_counts([[0.6] * block] * 3, [block] * 3, FREE, cost) == [block] * 3
        assert choose_shared_draft_count([[0.6] * block] * 3, [block] * 3, FREE, cost) == block


def test_nothing_where_drafting_cannot_pay() -> None:
    # compute-bound: k drafts cost (k + 1)^2 tokens' time for at most k + 1 tokens
    assert choose_draft_counts([[0.99] * 8] * 2, [8, 8], PER_TOKEN, SHIFTED) == [0, 0]
    assert choose_shared_draft_count([[0.99] * 8], [8], PER_TOKEN, UNSHIFTED) == 0
    # free tokens, but drafts that are never accepted
    assert choose_draft_counts([[0.0] * 8], [8], FREE, SHIFTED) == [0]


def test_the_measured_step_prices_drafting_steps() -> None:
    """A TiDAR step measured dearer than a plain forward of as many tokens (its branch
    attention calls, an eager forward) is priced from ``verify_points``; a step that
    drafts nothing is a plain AR step, priced from ``points``."""
    profile = load_latency_profile({"points": {"1": 0.010, "64": 0.010},
                                    "verify_points": {"4": 0.030, "64": 0.030}})
    assert SHIFTED.latency(profile, [3]) == pytest.approx(0.030)
    assert SHIFTED.latency(profile, [0, 0]) == pytest.approx(0.010)
    # E(3) = 1 + .9 + .81 + .73 = 3.4 tokens in 30 ms beat 1 token in 10 ms
    assert choose_draft_counts([[0.9] * 3], [3], profile, SHIFTED) == [3]
    # weak drafts (E(k) < 3 tokens) do not pay for a step three times dearer
    assert choose_draft_counts([[0.5] * 3], [3], profile, SHIFTED) == [0]
    assert choose_draft_counts([[0.5] * 3], [3], LatencyProfile({1: 0.01, 64: 0.01}),
                               SHIFTED) == [3]


def test_it_drafts_less_as_the_batch_grows() -> None:
    """The knee at 12 tokens: one request drafts 2 ((2 + 1)^2 = 9 tokens; 3 would be 16),
    two or three draft 1 each (4 tokens each), four none (16 > 12) when they share one
    count; per request the policy fits the drafts of some requests under the knee and
    leaves the rest at 0 (a plain AR step for them)."""
    acceptance = [0.9] * 8
    shared = [choose_shared_draft_count([acceptance] * b, [8] * b, KNEE, SHIFTED)
              for b in range(1, 8)]
    assert shared == [2, 1, 1, 0, 0, 0, 0]
    for b in range(1, 8):
        counts = choose_draft_counts([acceptance] * b, [8] * b, KNEE, SHIFTED)
        assert sum((1 + k) ** 2 for k in counts) <= 12, counts  # never past the knee
        assert max(counts) - min(counts) <= 1  # the same rates: spread evenly
    assert choose_draft_counts([acceptance] * 4, [8] * 4, KNEE, SHIFTED) == [1, 1, 0, 0]
    assert choose_draft_counts([acceptance] * 30, [8] * 30, KNEE, SHIFTED) == [0] * 30


def test_limits_per_request_are_kept() -> None:
    assert choose_draft_counts([[0.9] * 8] * 3, [8, 2, 0], FREE, SHIFTED) == [8, 2, 0]


def test_verify_outcomes_move_the_choice() -> None:
    """TiDAR verifies a step's drafts in the next step: the drafter feeds the estimate
    the drafts it verified and how many passed; rejected drafts stop the drafting."""
    policy = AdaptiveDrafts(8, LatencyProfile({1: 0.010, 4: 0.011, 81: 0.030}), SHIFTED)
    assert policy.choose_shared(["a"], [8]) > 0  # optimistic prior
    for _ in range(300):
        policy.estimate.update(policy.last_counts[0] or 1, 0)
        policy.choose_shared(["a"], [8])
    assert policy.last_counts == [0]


def test_the_sweep_profiles_smaller_tidar_steps_too() -> None:
    """``benchmarks/adaptive_sweep.py`` times TiDAR's quadratic forward at K, K/2 and 1 by
    default (its tokens grow with K^2), a two-forward method's passes at K only."""
    from benchmarks.adaptive_sweep import profile_draft_counts
    from benchmarks.baselines import Baseline

    assert profile_draft_counts(Baseline("tidar:8", "tidar", 8), None) == [1, 4, 8]
    assert profile_draft_counts(Baseline("tidar:1", "tidar", 1), None) == [1]
    assert profile_draft_counts(Baseline("orthrus:3", "orthrus", 3), None) == [3]
    assert profile_draft_counts(Baseline("tidar:8", "tidar", 8), "2,8") == [2, 8]


def test_a_step_timed_across_calls(tmp_path, monkeypatch) -> None:
    """The TiDAR drafters time a step from its forward to its next drafts (two calls)."""
    from diffspec.profiling import DRAFT_TIMINGS_ENV, DraftTimings, read_draft_timings

    path = tmp_path / "timings.txt"
    assert DraftTimings().start() is None  # unset: nothing timed, nothing written
    monkeypatch.setenv(DRAFT_TIMINGS_ENV, str(path))
    timings = DraftTimings()
    for _ in range(3):
        timings.stop(timings.start(), 81, kind="verify")
    timings.stop(None, 4, kind="verify")  # a step that was not started
    assert set(read_draft_timings(path, "verify")) == {81}
    assert len(path.read_text().splitlines()) == 3
