"""Adaptive drafting by default (issue 27): the speculative config's defaults, the start-up
profile's grid, timing loop and cache, and the online fit of whole-step times that prices
a profile measured without the engine's per-step work. Pure functions and stand-ins: no
engine, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffspec.core.adaptive import AdaptiveDrafts, LatencyProfile, StepCost, StepTimeFit
from diffspec.core.checkpoint import CheckpointError
from diffspec.plugin.vllm.config import diffspec_options
from diffspec.profiling import (
    CACHE_ENV,
    cache_dir,
    cached_latency_profile,
    checkpoint_identity,
    profile_grid,
    read_cached_profile,
    time_forwards,
)
from tests.unit.clock import Clock

TWO_PASS = StepCost("two_pass")
# compute-bound: every token costs the same (a forward of t tokens: t ms)
LINEAR_MS = LatencyProfile({1: 0.001, 1000: 1.0})
ROOFLINE_MS = LatencyProfile({1: 0.010, 64: 0.010, 1024: 0.160})  # flat to 64 tokens


# ------------------------------------------------------------------ the config


def test_adaptive_is_the_default(tmp_path: Path) -> None:
    lookup = {"min": 2, "max": 4}
    assert diffspec_options({"method": "orthrus"}) == {"adaptive": True, "prompt_lookup": lookup,
                                                      "carry": "auto"}
    assert diffspec_options({"method": "orthrus", "adaptive": False}) == {
        "adaptive": False, "prompt_lookup": None, "carry": "auto"}  # a fixed count: heads alone
    assert diffspec_options({"method": "linear_self_spec", "adaptive": False,
                             "prompt_lookup": {"max": 3}}) == {
        "adaptive": False, "prompt_lookup": {"min": 2, "max": 3}, "carry": "auto"}
    assert diffspec_options({"method": "orthrus", "prompt_lookup": False, "carry": False}) == {
        "adaptive": True, "prompt_lookup": None, "carry": "off"}
    assert diffspec_options({"method": "orthrus", "carry": "always"})["carry"] == "always"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"points": {"1": 0.01}}))
    options = diffspec_options({"method": "tidar", "latency_profile": str(profile)})
    assert options == {"adaptive": True, "latency_profile": str(profile.resolve()),
                       "prompt_lookup": None, "carry": "auto"}  # tidar: drafts cost no forward
    # carried drafts are the adaptive two-pass drafter's
    with pytest.raises(CheckpointError, match=r'^remove "carry": .*tidar pre-drafts'):
        diffspec_options({"method": "tidar", "carry": "always"})
    with pytest.raises(CheckpointError, match=r'^remove "carry": .*"adaptive": false drafts'):
        diffspec_options({"method": "orthrus", "adaptive": False, "carry": "off"})
    with pytest.raises(CheckpointError, match=r"^remove \"prompt_lookup\" .*'tidar'"):
        diffspec_options({"method": "tidar", "prompt_lookup": True})
    with pytest.raises(CheckpointError, match=r"^set prompt_lookup min <= max"):
        diffspec_options({"method": "orthrus", "prompt_lookup": {"min": 5}})


def test_a_profile_with_a_fixed_count_is_refused(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"points": {"1": 0.01}}))
    with pytest.raises(CheckpointError, match=r"^remove \"latency_profile\" or the "
                                              r"\"adaptive\": false"):
        diffspec_options({"method": "orthrus", "adaptive": False,
                          "latency_profile": str(profile)})
    with pytest.raises(CheckpointError, match=r"^point \"latency_profile\" at .*leave it out"):
        diffspec_options({"method": "orthrus", "latency_profile": str(tmp_path / "none")})


def test_sglang_options_are_vllms(tmp_path: Path) -> None:
    """SGLang reads the same keys from ``--json-model-override-args '{"diffspec": {...}}'``
    and refuses, with the server arguments, what vLLM refuses in its speculative config:
    ``adaptive`` other than true / false, a latency profile with ``"adaptive": false`` or
    one that cannot be read, an unknown key; no options at all is the default (adaptive,
    prompt lookup on)."""
    from types import SimpleNamespace

    from diffspec.plugin.sglang.config import _validate_diffspec_options

    def check(options: dict | None, method: str = "orthrus") -> None:
        raw = None if options is None else json.dumps({"diffspec": options})
        _validate_diffspec_options(SimpleNamespace(json_model_override_args=raw), method)

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"points": {"1": 0.01}}))
    for options in (None, {}, {"adaptive": False}, {"adaptive": True},
                    {"latency_profile": str(profile)}, {"adaptive": False, "prompt_lookup": True},
                    {"carry": "always"}, {"carry": False}):
        check(options)
        spec = {"method": "orthrus", **(options or {})}
        diffspec_options(spec)  # vLLM takes the same
    check({"latency_profile": str(profile)}, "tidar")
    refused = [
        ({"adaptive": "yes"}, r"^set \"adaptive\" to true .* or false"),
        ({"adaptive": False, "latency_profile": str(profile)},
         r"^remove \"latency_profile\" or the \"adaptive\": false"),
        ({"latency_profile": str(tmp_path / "none")},
         r"^point \"latency_profile\" at .*leave it out"),
        ({"adaptiv": False}, r"^remove 'adaptiv' from --json-model-override-args"),
        ({"carry": "sometimes"}, r"^set \"carry\" to \"auto\""),
        ({"adaptive": False, "carry": "always"}, r"^remove \"carry\""),
    ]
    for options, message in refused:
        with pytest.raises(CheckpointError, match=message):
            check(options)
        if "latency_profile" in options or "carry" in options:  # (vLLM checks the others'
            # keys and values first)
            with pytest.raises(CheckpointError, match=message):
                diffspec_options({"method": "orthrus", **options})


# ------------------------------------------------------------------ grid, timing, cache


def test_profile_grid() -> None:
    assert profile_grid(1) == [1]
    assert profile_grid(8) == [1, 2, 3, 4, 6, 8]
    assert profile_grid(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    with pytest.raises(ValueError):
        profile_grid(0)


def test_time_forwards_medians_within_the_budget() -> None:
    calls: list[int] = []
    noise = iter([0.0, 5.0, 0.0] * 100)  # one disturbed run in three: the median ignores it

    def timer(fn) -> float:
        fn()
        return calls[-1] * 0.1 + next(noise) * calls[-1]

    points = time_forwards(calls.append, [1, 2, 4, 8, 16], repeats=3, budget_s=4.0, timer=timer)
    # warm-up: 1 -> 0.1 s, 2 -> 10.2 s: its share (1 s) is spent, so 4, 8, 16 are not timed
    assert sorted(points) == [1, 2]
    assert calls == [1, 2] + [1, 2] * 3  # warm-up, then interleaved rounds
    assert points[1] == pytest.approx(0.1) and points[2] == pytest.approx(0.2)
    # ranks that time forwards together stop where the first says
    calls.clear()
    assert sorted(time_forwards(calls.append, [1, 2, 4, 8], repeats=1, budget_s=1e9,
                                timer=lambda fn: fn() or 0.0,
                                agree=lambda stop: len(calls) >= 3)) == [1, 2, 4]
    # 1 s a token: 1, 2 and 4 (7 s) fit a 10 s share, 8 would not (7 + 8 s): not run
    calls.clear()
    assert sorted(time_forwards(calls.append, [1, 2, 4, 8, 16], repeats=1, budget_s=20.0,
                                timer=lambda fn: fn() or float(calls[-1]))) == [1, 2, 4]
    assert 8 not in calls


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "diffspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "diffspec"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_profile_measured_once_then_reused(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured, lines = [], []

    def measure() -> dict[int, float]:
        measured.append(1)
        return {1: 0.01, 8: 0.02}

    key = {"engine": "vllm", "threads": 2, "grid": [1, 8]}
    first = cached_latency_profile(key, measure, lines.append)
    again = cached_latency_profile(key, measure, lines.append)
    assert measured == [1] and first.points == again.points == {1: 0.01, 8: 0.02}
    assert lines[0].startswith("diffspec: measured a latency profile in ")
    assert "(2 points, 1..8 tokens), cached at " + str(tmp_path) in lines[0]
    assert lines[1].startswith(f"diffspec: reused the latency profile {tmp_path}")
    # anything in the key changes: measured again, in its own file
    cached_latency_profile({**key, "threads": 1}, measure, lines.append)
    assert measured == [1, 1] and len(list((tmp_path / "latency-profiles").iterdir())) == 2
    # a corrupt file is measured again (and rewritten)
    _, path = read_cached_profile(key)
    path.write_text("{not json")
    cached_latency_profile(key, measure, lines.append)
    assert measured == [1, 1, 1] and read_cached_profile(key)[0] is not None


def test_tensor_parallel_ranks_take_rank_0s_profile(monkeypatch, tmp_path: Path) -> None:
    """Rank 0 alone reads / writes the cache and logs; every rank measures (the forwards'
    collectives) and takes rank 0's points (a stand-in broadcast: rank 0's object)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    key = {"engine": "sglang", "tensor_parallel": 2}
    sent: list = []

    def rank1_broadcast(obj):  # what rank 0 sends, in the order it sends it
        return sent.pop(0)

    sent[:] = [None, {1: 0.01, 4: 0.03}]  # rank 0: no cached profile, then its measurement
    rank1_lines: list[str] = []
    profile = cached_latency_profile(key, lambda: {1: 0.5, 4: 0.9}, rank1_lines.append,
                                     broadcast=rank1_broadcast, rank0=False)
    assert profile.points == {1: 0.01, 4: 0.03} and rank1_lines == []
    assert read_cached_profile(key)[0] is None  # rank 1 writes nothing

    rank0_lines: list[str] = []
    measured = cached_latency_profile(key, lambda: {1: 0.01, 4: 0.03}, rank0_lines.append,
                                      broadcast=lambda obj: obj, rank0=True)
    assert measured.points == {1: 0.01, 4: 0.03} and read_cached_profile(key)[0] is not None
    sent[:] = [{1: 0.01, 4: 0.03}]  # rank 0 found it cached: rank 1 measures nothing
    again = cached_latency_profile(key, lambda: 1 / 0, rank1_lines.append,
                                   broadcast=rank1_broadcast, rank0=False)
    assert again.points == {1: 0.01, 4: 0.03} and rank1_lines == []


def test_an_unwritable_cache_still_gives_the_profile(monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "sub"))  # a path under a file
    lines: list[str] = []
    profile = cached_latency_profile({"k": 1}, lambda: {1: 0.5}, lines.append)
    assert profile(1) == 0.5
    assert "not cached" in lines[0]


def test_checkpoint_identity_changes_with_the_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    before = checkpoint_identity(tmp_path)
    weights.write_bytes(b"xy")
    assert checkpoint_identity(tmp_path) != before
    assert checkpoint_identity("org/model", {"a": 1}) != checkpoint_identity("org/model",
                                                                             {"a": 2})


# ------------------------------------------------------------------ the step-time fit


def test_fit_starts_at_the_profile_and_learns_scale_and_overhead() -> None:
    fit = StepTimeFit([0.01, 0.1])
    assert (fit.scale, fit.overhead) == (1.0, 0.0) and fit.price(0.05) == 0.05
    for i in range(400):
        predicted = 0.01 + 0.09 * (i % 10) / 9
        assert fit.observe(predicted, 1.5 * predicted + 0.004)
    # the prior toward (1, 0) keeps it a little short of (1.5, 0.004); the prices are close
    assert 1.3 < fit.scale < 1.55 and 0.0 < fit.overhead < 0.012
    for predicted in (0.01, 0.02, 0.05, 0.1):
        assert fit.price(predicted) == pytest.approx(1.5 * predicted + 0.004, rel=0.15)


def test_fit_refuses_idle_gaps_and_tracks_a_change() -> None:
    fit = StepTimeFit([0.01, 0.1])
    for _ in range(100):
        fit.observe(0.02, 0.02)
    assert not fit.observe(0.02, 5.0)  # an idle gap between two generate calls
    assert fit.rejected == 1 and fit.price(0.02) == pytest.approx(0.02, rel=0.01)
    fit.observe(0.02, 0.02)
    for _ in range(300):  # the machine gets twice as slow (other work on its cores)
        fit.observe(0.02, 0.04)
        fit.observe(0.08, 0.16)
    assert fit.price(0.05) == pytest.approx(0.10, rel=0.05)


def test_the_fitted_overhead_makes_drafting_pay() -> None:
    """On a compute-bound profile a two-pass step of k drafts costs two forwards of k + 1
    tokens: a plain AR step wins. Measured steps that each take 20 ms more than the
    profile says (the engine's per-step work, in an AR step and a speculative step alike)
    make the second forward relatively cheap: then drafting wins."""
    clock = Clock()
    policy = AdaptiveDrafts(4, LINEAR_MS, TWO_PASS, track_step_times=True, clock=clock)
    policy.estimate.successes = [0.95 * t for t in policy.estimate.trials]
    assert policy.choose(["a"], [4]) == [0]  # no steps measured yet: the profile alone
    for _ in range(200):
        policy.step_started(["a"])
        k = policy.choose(["a"], [4])[0]
        clock.now += TWO_PASS.latency(LINEAR_MS, [k]) + 0.020  # what the step really took
    # steps of one size: the overhead moves, the scale stays near 1
    assert policy.fit.overhead > 0.012 and policy.fit.scale < 1.6
    ar_step = TWO_PASS.latency(LINEAR_MS, [0])
    assert policy.fit.price(ar_step) == pytest.approx(ar_step + 0.020, rel=0.2)
    assert policy.choose(["a"], [4]) == [4]


def test_a_profile_slower_than_serving_keeps_its_choices() -> None:
    """A profile measured under heavier load than serving (every live step a third of its
    price) once fitted a negative overhead: small steps priced down more than large ones,
    the policy stopped drafting after one step and, drafting nothing, never learned
    otherwise. Live steps only rescale the profile: the choice stays the profile's."""
    clock = Clock()
    profile = LatencyProfile({1: 0.05, 2: 0.052, 4: 0.056, 8: 0.064})  # memory-bound
    policy = AdaptiveDrafts(7, profile, TWO_PASS, track_step_times=True, clock=clock)
    policy.estimate.successes = [0.9 * t for t in policy.estimate.trials]
    first = policy.choose(["a"], [7])
    assert first[0] > 0
    for _ in range(100):
        policy.step_started(["a"])
        k = policy.choose(["a"], [7])[0]
        clock.now += TWO_PASS.latency(profile, [k]) / 3  # serving runs 3x faster
        assert k == first[0]
    assert policy.fit.overhead == 0.0 and policy.fit.scale < 0.9


def test_steps_of_a_changing_batch_are_not_learned() -> None:
    clock = Clock()
    policy = AdaptiveDrafts(4, LINEAR_MS, TWO_PASS, track_step_times=True, clock=clock)
    for batch in (["a"], ["a", "b"], ["b"], ["a"]):  # a join, a leave, another request
        policy.step_started(batch)
        policy.choose(batch, [4] * len(batch))
        clock.now += 0.01
    policy.step_started(["x"])
    assert policy.fit.steps == 0
    # a step the drafter marks as not to learn (a prefill chunk in it): neither the step
    # that ends there nor the one that starts there
    for batch in (["a"], [], ["a"], ["a"]):
        policy.step_started(batch)
        k = policy.choose(["a"], [4])[0]
        clock.now += TWO_PASS.latency(LINEAR_MS, [k])  # as priced: never an outlier
    assert policy.fit.steps == 1


def test_a_supplied_profile_is_not_fitted_and_none_is_refused() -> None:
    policy = AdaptiveDrafts(4, LINEAR_MS, TWO_PASS)
    assert policy.fit is None and policy.pricing is TWO_PASS
    pending = AdaptiveDrafts(4, None, TWO_PASS, track_step_times=True)
    with pytest.raises(RuntimeError, match="^measure the latency profile"):
        pending.choose(["a"], [4])
    pending.set_profile(LINEAR_MS)
    assert pending.fit is not None and pending.choose(["a"], [4]) == [0]


def test_the_rate_guard_keeps_the_faster_kind_of_step() -> None:
    from diffspec.core.adaptive import RateGuard

    guard = RateGuard(min_steps=8, explore_every=32, probe_every=4)
    assert all(guard.allows(4) for _ in range(5))  # nothing measured: the policy's choice
    for _ in range(8):
        guard.observe(4, True, 8, 0.040)  # drafting: 200 tokens/s
    probes = [guard.allows(4) for _ in range(16)]
    assert probes.count(False) == 4  # every 4th drafting choice measures a plain step
    for _ in range(8):
        guard.observe(4, False, 4, 0.010)  # plain: 400 tokens/s
    choices = [guard.allows(4) for _ in range(64)]
    assert choices.count(True) == 2  # plain measures faster: drafting every 32nd step
    assert guard.allows(2)  # other batch sizes are measured on their own
    for _ in range(100):
        guard.observe(4, True, 16, 0.040)  # the drafts get better: 400 -> 400+ tokens/s
        guard.observe(4, True, 20, 0.040)
    assert guard.rate(4, True) > guard.rate(4, False)
    assert [guard.allows(4) for _ in range(64)].count(False) == 2
    assert "batch 4: " in guard.summary()
    with pytest.raises(ValueError, match="min_steps >= 1"):
        RateGuard(min_steps=0)


def test_measured_rates_stop_drafting_that_the_fit_keeps() -> None:
    """Drafting steps that take 4x a plain step where the profile says 2x: the fit, which
    sees only drafting steps, reads the extra 20 ms as per-step overhead that a plain step
    would pay too, so the priced choice keeps drafting, at 300 tokens/s against plain
    steps' 400. The measured tokens per second stop it: of the last 40 steps, only the
    guard's exploration steps draft."""
    def run(guard: bool) -> list[int]:
        clock = Clock()
        policy = AdaptiveDrafts(7, ROOFLINE_MS, TWO_PASS, track_step_times=True, clock=clock)
        if not guard:
            policy.guard = None
        batch, counts, emitted = ["a", "b", "c", "d"], [], None
        for _ in range(240):
            policy.step_started(batch, emitted)
            ks = policy.choose(batch, [7] * 4)
            counts.append(sum(ks))
            emitted = sum(1 + min(k, 2) for k in ks)  # two drafts accepted of each block
            for req, k in zip(batch, ks):
                policy.observe(req, 1 + min(k, 2))
            clock.now += 0.040 if any(ks) else 0.010
        return counts

    assert all(run(guard=False)[-40:])
    last = run(guard=True)[-40:]
    assert 1 <= sum(1 for k in last if k) <= 2


def test_the_rate_guard_turns_down_the_draft_pass_not_the_lookup_drafts() -> None:
    """The drafter's steps measure slower than plain ones (as above), while one request's
    context holds n-gram matches: the guard stops the draft pass, and that request keeps
    its lookup drafts (they cost no draft pass) in every step without a draft pass; in the
    guard's exploration steps, which pay the draft pass, it drafts from whichever source
    promises more (the pass is paid anyway)."""
    clock = Clock()
    policy = AdaptiveDrafts(7, ROOFLINE_MS, TWO_PASS, track_step_times=True, clock=clock)
    batch, emitted, history = ["a", "b", "c", "d"], None, []
    for _ in range(240):
        policy.step_started(batch, emitted)
        ks, lookup = policy.choose_hybrid(batch, [7] * 4, [4, 0, 0, 0])  # "a" has a match
        assert not any(lookup[1:])  # no match: never lookup
        passes = any(k and not f for k, f in zip(ks, lookup))
        history.append((ks[0] if lookup[0] or passes else 0, passes))
        emitted = sum(1 + min(k, 2) for k in ks)
        for req, k in zip(batch, ks):
            policy.observe(req, 1 + min(k, 2))
        clock.now += 0.040 if passes else 0.010
    last = history[-40:]
    assert 1 <= sum(p for _, p in last) <= 2  # the draft pass: the guard's exploration only
    # "a" drafts every step (lookup drafts without a pass, measured faster than plain
    # steps), but the free-draft guard's exploration of plain steps (1 in 32)
    assert sum(k > 0 for k, _ in last) >= 38
    assert policy.guard.rate(4, False) > policy.guard.rate(4, True)
    assert policy.free_guard.rate(4, True) > policy.free_guard.rate(4, False)


def test_free_drafts_that_measure_slower_than_plain_steps_are_turned_down() -> None:
    """Issue 47 (the default below AR at 16 requests): the profile prices a lookup draft's
    verify tokens as nearly free, but the batch's steps with lookup drafts take 2x a plain
    step for 25% more tokens. The drafter's guard never sees them (no draft pass); the
    free-draft guard measures them against plain steps at the batch size and turns them
    down, exploring 1 step in 32; a batch where they pay keeps them."""
    def run(lookup_seconds: float) -> list[bool]:
        clock = Clock()
        flat = LatencyProfile({1: 0.010, 64: 0.011})
        policy = AdaptiveDrafts(7, flat, TWO_PASS, track_step_times=True, clock=clock)
        batch, emitted, drafted = ["a", "b", "c", "d"], None, []
        for _ in range(240):
            policy.step_started(batch, emitted)
            ks, lookup = policy.choose_hybrid(batch, [0] * 4, [4] * 4)  # lookup drafts only
            emitted = sum(1 + min(k, 1) for k in ks)  # one lookup draft accepted each
            for req, k in zip(batch, ks):
                policy.observe(req, 1 + min(k, 1))
            clock.now += lookup_seconds if any(ks) else 0.010
            drafted.append(any(ks))
        return drafted[-64:]

    slow = run(0.020)  # 8 tokens in 20 ms against 4 in 10: slower
    assert 1 <= sum(slow) <= 3
    assert sum(run(0.012)) >= 61  # 8 tokens in 12 ms: faster, kept


def test_vllm_policy_starts_from_the_checkpoints_measured_acceptance() -> None:
    """vLLM's drafters build their policy from the engine config: config.json's
    diffspec_draft_acceptance (what materialize_orthrus writes for the embedded default)
    is the drafter's prior; without it, 0.8 at every position."""
    from types import SimpleNamespace

    from diffspec.spec_workers.vllm.proposer import adaptive_policy

    def config(**hf) -> SimpleNamespace:
        return SimpleNamespace(additional_config={"diffspec": {"adaptive": True}},
                               model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)),
                               parallel_config=SimpleNamespace(tensor_parallel_size=1))

    measured = adaptive_policy(config(diffspec_draft_acceptance=[0.9, 0.45, 0.09]), 7,
                               "two_pass")
    assert measured.estimate.conditional[:3] == pytest.approx([0.9, 0.5, 0.2])
    assert measured.estimate.conditional[3:] == pytest.approx([0.2] * 4)  # the last rate on
    plain = adaptive_policy(config(), 7, "two_pass")
    assert plain.estimate.conditional == pytest.approx([0.8] * 7)


def test_the_cached_profiles_key_has_the_settings_a_step_time_depends_on() -> None:
    """A profile measured under one attention backend (global or per KV-cache kind),
    CUDA-graph mode or KV-cache dtype is not reused under another: each is in the key
    (the runner's own backends where it has attention groups)."""
    from types import SimpleNamespace

    from diffspec.spec_workers.vllm.proposer import profile_settings

    def config(backend=None, per_kind=None, graphs="FULL_AND_PIECEWISE", kv="auto"):
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}),
            compilation_config=SimpleNamespace(cudagraph_mode=graphs),
            cache_config=SimpleNamespace(cache_dtype=kv))

    keys = [profile_settings(c) for c in (
        config(), config(backend="TRITON_ATTN"), config(per_kind={"full": "FLASHINFER"}),
        config(graphs="NONE"), config(kv="fp8"))]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == len(keys)

    class Backend:
        @staticmethod
        def get_name() -> str:
            return "CPU_ATTN"

    runner = SimpleNamespace(attn_groups=[[SimpleNamespace(backend=Backend)]])
    assert profile_settings(config(backend="TRITON_ATTN"), runner)["attention_backends"] == [
        "CPU_ATTN"]
