"""The load benchmark's engine-free parts: the sweep loops (``benchmarks/adapters/sweep.py``)
driven by a stand-in ``generate`` (a pure function of its inputs), the summary of
``benchmarks/adaptive_sweep.py``, and the draft-pass timings file the engines' drafters
write (:class:`diffspec.profiling.DraftTimings`)."""

from __future__ import annotations

import time

import pytest

from benchmarks.adapters import sweep
from benchmarks.adapters.sweep import (
    RUN_MARKER,
    pick,
    run_each,
    run_job,
    step_times,
    system_tokens_per_s,
    waves,
)


class Clock:
    """A virtual ``time`` for the sweep loops: the stand-in engines advance it instead of
    sleeping, so the timed results are exact, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(sweep, "time", c)
    return c


def _echo(step_s: float = 0.0, draft: int = 0, clock: Clock | None = None):
    """A stand-in engine: each output repeats its prompt's first token ``max_tokens`` times;
    one call takes ``step_s`` per token (a decode step per token) on ``clock``, plus a
    fixed 5 ms (the prefill and the call's costs)."""
    calls = []

    def generate(prompts, max_tokens):
        calls.append((len(prompts), max_tokens))
        if clock is not None:
            clock.advance(0.005 + step_s * max_tokens)
        return ([[p[0]] * max_tokens for p in prompts],
                {"drafts": draft * len(prompts), "draft_tokens": 2 * draft * len(prompts),
                 "accepted": draft})
    return generate, calls


def test_pick_cycles() -> None:
    assert pick([[1], [2]], 5) == [[1], [2], [1], [2], [1]]


def test_waves_serve_c_requests_at_a_time(clock: Clock) -> None:
    generate, calls = _echo(draft=1, clock=clock)
    rows = waves(generate, [[i] for i in range(10)], [1, 3], repeats=2, max_tokens=5)
    assert [(r["repeat"], r["concurrency"]) for r in rows] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    assert [c for c, _ in calls] == [1] * 4 + [3, 3] + [1] * 4 + [3, 3]
    first = rows[1]
    assert first["num_prompts"] == 6 and first["tokens"] == 30
    assert first["token_ids"] == [[i] * 5 for i in range(6)]
    assert first["drafts"] == 6 and first["draft_tokens"] == 12 and first["accepted"] == 2
    assert "token_ids" not in rows[3]  # kept for the first repeat only


def test_step_times_cancel_the_fixed_costs(clock: Clock) -> None:
    generate, _ = _echo(step_s=0.002, clock=clock)
    steps = step_times(generate, [[1]], [1, 2], short=2, long=12, repeats=1)
    assert steps == {1: pytest.approx(0.002), 2: pytest.approx(0.002)}
    with pytest.raises(ValueError):
        step_times(generate, [[1]], [1], short=5, long=5)


def test_run_job_modes(clock: Clock) -> None:
    generate, _ = _echo(step_s=0.001, clock=clock)
    job = {"prompts": [[7]], "concurrency": [2], "repeats": 1, "max_tokens": 3,
           "batch_sizes": [1], "short": 1, "long": 2, "step_repeats": 1}
    assert run_job("waves", generate, job)["waves"][0]["tokens"] == 12
    assert set(run_job("steps", generate, job)["step_s"]) == {1}
    with pytest.raises(ValueError, match="mode"):
        run_job("nope", generate, job)


def test_run_each_keeps_going_after_a_failing_run(clock: Clock, capsys) -> None:
    """The workers' loop: every run on an engine of its own, stopped after it; a run whose
    engine fails to start is an error row and the next one still runs; serve mode calls
    ``serve``, the sweep modes :func:`run_job` on ``batch(engine)``."""
    started, stopped = [], []

    def start(run):
        if run["name"] == "broken":
            raise RuntimeError("no CPU kernel")
        started.append(run["name"])
        return run["name"]

    job = {"runs": [{"name": "ar"}, {"name": "broken"}, {"name": "orthrus"}]}
    runs = run_each(job, start, lambda engine, run: {"served_by": engine},
                    lambda engine: None, stop=stopped.append)
    assert runs == {"ar": {"served_by": "ar"}, "broken": {"error": "RuntimeError: no CPU kernel"},
                    "orthrus": {"served_by": "orthrus"}}
    assert started == stopped == ["ar", "orthrus"]
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith(RUN_MARKER)] == [
        f"{RUN_MARKER}{name}" for name in ("ar", "broken", "orthrus")]
    assert "run broken failed" in err

    generate, _ = _echo(step_s=0.001, clock=clock)
    job = {"mode": "waves", "runs": [{"name": "ar"}], "prompts": [[7]], "concurrency": [1],
           "repeats": 1, "max_tokens": 3}
    runs = run_each(job, lambda run: "engine", lambda engine, run: {}, lambda engine: generate)
    assert runs["ar"]["waves"][0]["tokens"] == 12


def test_system_tokens_per_s_one_at_a_time_then_in_waves(clock: Clock) -> None:
    completions = [{"token_ids": [1] * 4, "latency_s": 0.5},
                   {"token_ids": [1] * 6, "latency_s": 1.5}]
    waves_served = []

    def serve_wave(wave):
        waves_served.append(len(wave))
        clock.advance(0.25)
        return 5 * len(wave)

    system = system_tokens_per_s(completions, [[1], [2], [3]], [1, 2], serve_wave)
    assert waves_served == [2, 1]
    assert system == {1: pytest.approx(10 / 2.0), 2: pytest.approx(15 / 0.5)}


def test_summary_compares_with_ar() -> None:
    from benchmarks.adaptive_sweep import summarize

    def run(rate: float, outputs: list[list[int]], draft_tokens: int = 0) -> dict:
        return {"waves": [{"repeat": r, "concurrency": 2, "seconds": 10 / (rate * f),
                           "tokens": 10, "draft_tokens": draft_tokens, "accepted": 0,
                           **({"token_ids": outputs} if r == 0 else {})}
                          for r, f in ((0, 1.0), (1, 1.1), (2, 0.9))]}
    runs = {"ar": run(10.0, [[1, 2], [3]]), "k": run(15.0, [[1, 2], [3, 4]], draft_tokens=5)}
    rows = {r["baseline"]: r for r in summarize(runs, [2])}
    assert rows["ar"]["x_ar"] == pytest.approx(1.0) and rows["ar"]["lossless"] == 1.0
    assert rows["k"]["x_ar"] == pytest.approx(1.5)
    assert rows["k"]["min"] == pytest.approx(13.5) and rows["k"]["max"] == pytest.approx(16.5)
    assert rows["k"]["lossless"] == 0.5  # one output of two differs from AR's
    assert rows["k"]["draft_tokens_per_token"] == pytest.approx(0.5)


def test_draft_timings_off_by_default(monkeypatch, tmp_path) -> None:
    from diffspec.profiling import DRAFT_TIMINGS_ENV, DraftTimings, read_draft_timings

    monkeypatch.delenv(DRAFT_TIMINGS_ENV, raising=False)
    assert DraftTimings("cpu").time(4, lambda: "x") == "x"
    path = tmp_path / "t.txt"
    monkeypatch.setenv(DRAFT_TIMINGS_ENV, str(path))
    timings = DraftTimings("cpu")
    for tokens in (4, 4, 4, 8):
        assert timings.time(tokens, lambda: time.sleep(0.001) or 5) == 5
    timings.time(12, lambda: None, kind="verify")
    table = read_draft_timings(path)
    assert list(table) == [4]  # 8 was seen once: too few to trust
    assert table[4] >= 0.001
    assert read_draft_timings(path, min_count=1).keys() == {4, 8}
    assert read_draft_timings(path, "verify", min_count=1).keys() == {12}


def test_context_steps_per_verify_step_and_draft_passes(tmp_path, clock: Clock) -> None:
    """Whole-step time divides by the engine's verify steps (a spec engine emitting 2
    tokens a step takes half the steps), the prompt is cut to each context, and the draft
    passes the drafter wrote during that length's calls are its median."""
    from benchmarks.adapters.sweep import context_steps

    timings = tmp_path / "timings.txt"
    seen = []

    def spec(prompts, max_tokens):  # 2 tokens per verify step, 4 ms a step
        seen.append(len(prompts[0]))
        steps = max_tokens // 2
        clock.advance(0.005 + 0.004 * steps)
        with timings.open("a") as f:
            f.writelines(f"draft 4 {0.001 * len(prompts[0]):.6f}\n" for _ in range(steps))
        return [[1] * max_tokens], {"drafts": steps}

    rows = context_steps(spec, list(range(100)), [10, 50], short=4, long=24, repeats=1,
                         timings=str(timings))
    assert seen == [10, 10, 50, 50]
    assert [r["context"] for r in rows] == [10, 50] and rows[1]["steps"] == 12
    # per verify step (4 ms), not per token (2 ms); the fixed 5 ms cancels
    assert [r["step_s"] for r in rows] == [pytest.approx(0.004)] * 2
    assert rows[0]["draft_s"] == pytest.approx(0.01) and rows[1]["draft_s"] == pytest.approx(0.05)
    assert rows[0]["verify_s"] is None
    with pytest.raises(ValueError, match="longer than the prompt"):
        context_steps(spec, [1, 2], [10])
    # plain AR: the timings file is never written; steps are tokens after the first
    ar = context_steps(lambda prompts, n: ([[1] * n], {}), list(range(20)), [10],
                       short=2, long=6, repeats=1, timings=str(tmp_path / "none.txt"))
    assert ar[0]["steps"] == 5 and ar[0]["draft_s"] is None


def test_step_vs_context_table() -> None:
    from benchmarks.step_vs_context import render, rows_of

    def row(context, step, draft=None):
        return {"context": context, "step_s": step, "steps": 10, "draft_s": draft,
                "verify_s": None}

    runs = {"ar": {"context": [row(256, 0.05), row(4096, 0.10)]},
            "spec": {"context": [row(256, 0.10, 0.04), row(4096, 0.30, 0.15)]}}
    rows = rows_of("vllm", runs)
    assert [r["spec_over_ar"] for r in rows] == pytest.approx([2.0, 3.0])
    text = render({"meta": {"command": "c", "date": "d", "machine": "m", "note": "n"},
                   "engines": {"vllm": {"rows": rows}, "sglang": {"error": "boom"}}})
    assert "| 256 | 50.0 | 100.0 | 40.0 | - | 2.00 | 1.00 |" in text
    assert "| 4096 | 100.0 | 300.0 | 150.0 | - | 3.00 | 1.50 |" in text
    assert "error: boom" in text


def test_set_waves_writes_each_row_as_it_is_measured(clock: Clock, tmp_path) -> None:
    """``set_waves`` (benchmarks/serve_tables.py's offline cells): each (set, c) row is in
    the rows file once measured, with its outputs, so a worker that dies keeps them."""
    import json

    generate, calls = _echo(step_s=0.001, draft=1, clock=clock)
    rows_file = tmp_path / "rows.jsonl"
    sets = [{"name": "a", "prompts": [[1], [2], [3], [4]], "concurrency": [1, 2]},
            {"name": "b", "prompts": [[9]], "concurrency": [4]}]
    job = {"sets": sets, "max_tokens": 3, "min_prompts": 2, "waves_per_concurrency": 1,
           "rows_file": str(rows_file)}
    assert run_job("set_waves", generate, job) == {"rows": 3}
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [(r["set"], r["concurrency"], r["num_prompts"]) for r in rows] == [
        ("a", 1, 2), ("a", 2, 2), ("b", 4, 4)]
    assert rows[0]["token_ids"] == [[1] * 3, [2] * 3]
    assert rows[2]["token_ids"] == [[9] * 3] * 4  # fewer prompts than requests: cycled
    assert calls[0] == (1, 4)  # the warm-up, then waves of c
    assert [c for c, _ in calls[1:]] == [1, 1, 2, 4]
