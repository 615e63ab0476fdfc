"""The adaptive draft-count policy priced for TiDAR / NLD quadratic steps (``StepCost
("quadratic", skip)``) on hand-built latency profiles: a step with ``k`` drafts forwards the
verify chain and ``k + 1`` branches of ``k + skip`` masks per request, in one forward,
priced by the whole step measured for as many requests drafting ``k`` (``step_grid``) or,
in profiles without one, by its query tokens (``verify_points``); nothing drafted is a
plain AR step. Also the drafters' step timings that fill ``step_grid``."""

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


# ------------------------------------------------------------------------------ step_grid

AR_STEP = {1: 0.010, 16: 0.012}  # plain AR steps: 16 requests cost little more than one


def _grid_profile(grid: dict[int, dict[int, float]]) -> LatencyProfile:
    return LatencyProfile(AR_STEP, step_grid=grid)


def test_a_dear_batch_step_takes_plain_ar_steps() -> None:
    """Steps measured by requests and drafts: one request drafting the block costs 1.5 AR
    steps (the full block pays), 16 requests drafting even 1 each cost 3 (nothing pays: k
    = 0, plain AR steps), though a 16-request step with 1 draft forwards fewer tokens (64)
    than one request with 8 (81)."""
    profile = _grid_profile({1: {1: 0.012, 4: 0.013, 8: 0.015},
                             16: {1: 0.036, 4: 0.060, 8: 0.150}})
    acceptance = [0.9] * 8
    assert choose_shared_draft_count([acceptance], [8], profile, SHIFTED) == 8
    assert choose_shared_draft_count([acceptance] * 16, [8] * 16, profile, SHIFTED) == 0
    policy = AdaptiveDrafts(8, profile, SHIFTED)
    assert policy.choose_shared([f"r{i}" for i in range(16)], [8] * 16) == 0
    assert policy.last_counts == [0] * 16
    # priced by requests and drafts, not query tokens
    assert SHIFTED.latency(profile, [1] * 16) > SHIFTED.latency(profile, [8])


def test_a_free_batch_step_drafts_the_full_block() -> None:
    flat = {1: 0.0125, 8: 0.0125}
    profile = _grid_profile({1: flat, 16: flat})
    for cost, block in ((SHIFTED, 8), (UNSHIFTED, 7)):
        for b in (1, 4, 16, 32):
            assert choose_shared_draft_count([[0.6] * block] * b, [block] * b, profile,
                                             cost) == block
    # drafts that are never accepted still are not worth a dearer step
    assert choose_shared_draft_count([[0.0] * 8] * 16, [8] * 16, profile, SHIFTED) == 0


def test_step_grid_interpolates_over_drafts_then_requests() -> None:
    profile = _grid_profile({1: {1: 0.020, 4: 0.050}, 16: {2: 0.100, 4: 0.160}})
    assert profile.quadratic(1, 4) == 0.050 and profile.quadratic(16, 4) == 0.160
    assert profile.quadratic(1, 2) == pytest.approx(0.030)  # linear in k within a row
    assert profile.quadratic(16, 1) == 0.100  # below the row's first k: its seconds
    assert profile.quadratic(1, 6) == pytest.approx(0.070)  # past the last: its line
    # between rows, linear in the requests: 4 requests at k = 4, 3/15 of the way
    assert profile.quadratic(4, 4) == pytest.approx(0.050 + 0.110 * 3 / 15)
    assert profile.quadratic(31, 4) == pytest.approx(0.270)  # past the last row
    assert profile.quadratic(16, 0) == profile(16) == 0.012  # k = 0: a plain AR step
    # never below a plain AR step of as many requests
    assert _grid_profile({1: {1: 0.001}}).quadratic(16, 1) == 0.012
    # a step of mixed counts costs what one where every request drafts the most does
    assert SHIFTED.latency(profile, [4, 0, 1] + [0] * 13) == profile.quadratic(16, 4)
    assert SHIFTED.latency(profile, [0] * 16) == profile(16)
    with pytest.raises(ValueError, match="step_grid"):
        LatencyProfile(AR_STEP).quadratic(1, 1)
    with pytest.raises(ValueError, match="step_grid"):
        LatencyProfile(AR_STEP, step_grid={1: {}})
    with pytest.raises(ValueError, match="step_grid"):
        LatencyProfile(AR_STEP, step_grid={4: {0: 0.01}})
    with pytest.raises(ValueError, match="step_grid"):
        load_latency_profile({"points": {"1": 0.01}, "step_grid": {"4": {}}})


def test_profiles_with_and_without_step_grid_load() -> None:
    """``step_grid`` as ``adaptive_sweep`` writes it (JSON: string keys) prices quadratic
    steps; a profile without it (older files, or an empty one) prices them by query tokens
    as before."""
    old = {"points": {"1": 0.010, "64": 0.010}, "draft_points": {},
           "verify_points": {"4": 0.030, "64": 0.030}, "meta": {"method": "tidar:8"}}
    for data in (old, {**old, "step_grid": {}}):
        profile = load_latency_profile(data)
        assert profile.step_grid is None
        assert SHIFTED.latency(profile, [3]) == profile.verify(16) == pytest.approx(0.030)
        assert SHIFTED.latency(profile, [1] * 16) == profile.verify(64)
    grid = load_latency_profile({**old, "step_grid": {"16": {"1": 0.040, "8": 0.200}}})
    assert grid.step_grid == {16: {1: 0.040, 8: 0.200}}
    assert SHIFTED.latency(grid, [1] * 16) == 0.040
    assert SHIFTED.latency(grid, [3]) == pytest.approx(0.040 + 0.160 * 2 / 7)
    assert grid.verify_points == {4: 0.030, 64: 0.030}  # still loaded


def test_measured_points_are_priced_as_measured() -> None:
    """A noisy profile whose one-request AR step measured dearer than 16 requests' prices
    the 16-request step as measured (not raised to the one-request step), and a last
    segment that falls is not extrapolated below its last point."""
    noisy = LatencyProfile({1: 0.0035, 8: 0.0033, 16: 0.0029, 64: 0.0049})
    assert noisy(16) == 0.0029 and noisy(12) == pytest.approx(0.0031)
    assert LatencyProfile({4: 0.010, 324: 0.0103, 400: 0.0091})(1296) == 0.0091


# ------------------------------------------------------------------------------ step timings


def test_steady_steps_are_timed_whole(tmp_path, monkeypatch) -> None:
    """The drafters mark every step; the span from a steady step's mark to the next mark
    (all of its requests verified and pre-drafted the same k) is recorded by requests and
    k, unless a request that was not in it runs next (another call's prefill)."""
    from diffspec.profiling import DRAFT_TIMINGS_ENV, DraftTimings, read_step_grid

    path = tmp_path / "timings.txt"
    monkeypatch.setenv(DRAFT_TIMINGS_ENV, str(path))
    timings = DraftTimings()
    ab = ["a", "b"]
    timings.step(ab, [], [])  # prefill: not steady
    timings.step(ab, [4, 4], [4, 4])  # steady, k = 4
    timings.step(ab, [4, 4], [4, 4])  # the first 2-request step recorded here
    timings.step(["a"], [4], [4])  # b finished: the second one too
    timings.step(["c"], [4], [4])  # another request ran: a's step is not recorded
    timings.step(["c"], [4], [2])  # c's is; this one verifies 4, pre-drafts 2: not steady
    timings.step(["c"], [2], [2])
    timings.step(ab, [0, 0], [0, 0])  # new requests: c's k = 2 step is not recorded
    timings.step(ab, [3], [3])  # no drafts before; one of two requests has branches now
    timings.step(ab, [], [])
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [line[:3] for line in lines] == [["step", "2", "4"]] * 2 + [["step", "1", "4"]]
    assert all(float(line[3]) >= 0 for line in lines)
    grid = read_step_grid(path, min_count=1)
    assert grid == {1: {4: float(lines[2][3])},
                    2: {4: pytest.approx((float(lines[0][3]) + float(lines[1][3])) / 2)}}
    assert read_step_grid(path, min_count=2).keys() == {2}
    assert read_step_grid(path) == {}  # 2 samples at most: too few to trust
    # the token-keyed readers skip these lines
    timings.stop(timings.start(), 81, kind="verify")
    from diffspec.profiling import read_draft_timings
    assert read_draft_timings(path, "verify", min_count=1).keys() == {81}
    monkeypatch.delenv(DRAFT_TIMINGS_ENV)
    DraftTimings().step(ab, [4, 4], [4, 4])  # unset: nothing written


def test_the_sweep_profiles_tidar_at_the_batch_sizes_it_serves() -> None:
    from benchmarks.adaptive_sweep import build_parser, full_rows, profile_draft_batch_sizes
    from benchmarks.baselines import Baseline

    args = build_parser().parse_args(["--out", "x", "--concurrency", "1,4,16",
                                      "--profile-batch-sizes", "1,2,8,32"])
    assert profile_draft_batch_sizes(Baseline("tidar:8", "tidar", 8), args) == [1, 2, 4, 8, 16]
    assert profile_draft_batch_sizes(Baseline("orthrus:3", "orthrus", 3), args) == [1, 4, 16]
    # a batch size met only as requests finished, at some draft counts: left out
    grid = {4: {1: 0.01, 4: 0.02, 8: 0.03}, 3: {8: 0.025}}
    assert full_rows(grid, [1, 4, 8]) == {4: grid[4]}
    assert full_rows(grid, [8]) == grid
