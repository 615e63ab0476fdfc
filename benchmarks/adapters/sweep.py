"""Engine-free loops of the offline workers, shared by ``vllm_worker.py`` and
``sglang_worker.py`` (each passes its engine's calls): every run of a job on its own engine
(:func:`run_each`, the result line after ``RESULT_PREFIX``), the serve mode's system tokens/s
(:func:`system_tokens_per_s`), and for the load benchmarks a concurrency sweep in waves
(:func:`waves`), the same over several prompt sets with each row written as it finishes
(:func:`set_waves`, ``benchmarks/serve_tables.py``'s offline cells), AR step times by
batch size (:func:`step_times`) and step times by context length (:func:`context_steps`).

``generate(prompts, max_tokens) -> (token_ids, counters)``: the engine serves ``prompts``
(token ids) together, greedy, ``max_tokens`` each, EOS ignored, and returns each output's
token ids and the spec-decode counters of the call (``{"drafts", "draft_tokens",
"accepted"}``, zeros for plain AR).
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

Generate = Callable[[list[list[int]], int], tuple[list[list[int]], dict[str, int]]]
COUNTERS = ("drafts", "draft_tokens", "accepted")
RESULT_PREFIX = "DIFFSPEC_BENCH_RESULT "  # a worker's one stdout line: the JSON after it
RUN_MARKER = "DIFFSPEC_BENCH_RUN "  # on stderr before each run: its log is the slice after it


def pick(prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """The first ``n`` prompts, cycling when there are fewer."""
    return [list(prompts[i % len(prompts)]) for i in range(n)]


def waves(generate: Generate, prompts: Sequence[list[int]], concurrency: Sequence[int],
          repeats: int, max_tokens: int, waves_per_concurrency: int = 2,
          min_prompts: int = 4) -> list[dict[str, Any]]:
    """For each repeat, for each concurrency ``c``: the first ``max(min_prompts,
    waves_per_concurrency * c)`` prompts in waves of ``c`` (every request of a wave runs to
    ``max_tokens``, so ``c`` requests are in flight the whole wave). One row per (repeat,
    c): seconds, output tokens, counters, and (first repeat only) each output's token ids."""
    rows = []
    for repeat in range(repeats):
        for c in concurrency:
            chosen = pick(prompts, max(min_prompts, waves_per_concurrency * c))
            outputs: list[list[int]] = []
            counters = dict.fromkeys(COUNTERS, 0)
            start = time.perf_counter()
            for i in range(0, len(chosen), c):
                ids, stats = generate(chosen[i:i + c], max_tokens)
                outputs += ids
                for key in COUNTERS:
                    counters[key] += int(stats.get(key, 0))
            seconds = time.perf_counter() - start
            rows.append({"repeat": repeat, "concurrency": c, "seconds": seconds,
                         "num_prompts": len(chosen),
                         "tokens": sum(len(o) for o in outputs), **counters,
                         **({"token_ids": outputs} if repeat == 0 else {})})
            print(f"[sweep] repeat {repeat} c={c}: {rows[-1]['tokens'] / seconds:.1f} tok/s",
                  flush=True)
    return rows


def set_waves(generate: Generate, sets: Sequence[dict[str, Any]], max_tokens: int,
              waves_per_concurrency: int = 2, min_prompts: int = 4,
              rows_file: str | None = None) -> int:
    """:func:`waves` (one repeat) for each prompt set ``{"name", "prompts", "concurrency"}``
    at each of its concurrencies; each row (with ``"set"`` and the outputs' token ids) is
    appended to ``rows_file`` (JSON lines) the moment it is measured, so a run that dies
    keeps its finished rows. Returns the number of rows."""
    import json

    count = 0
    for s in sets:
        for c in s["concurrency"]:
            [row] = waves(generate, s["prompts"], [c], 1, max_tokens, waves_per_concurrency,
                          min_prompts)
            if rows_file:
                with open(rows_file, "a") as f:
                    f.write(json.dumps({"set": s["name"], **row}) + "\n")
            count += 1
    return count


def step_times(generate: Generate, prompts: Sequence[list[int]], batch_sizes: Sequence[int],
               short: int = 4, long: int = 20, repeats: int = 2) -> dict[int, float]:
    """Seconds per decode step with ``B`` requests in flight, for each ``B`` of
    ``batch_sizes``: ``(t(long) - t(short)) / (long - short)``, each ``t`` the least of
    ``repeats`` timed calls (the prefill and the call's fixed costs cancel)."""
    if not 0 < short < long:
        raise ValueError(f"need 0 < short < long, got {short}, {long}")
    out = {}
    for b in batch_sizes:
        chosen = pick(prompts, b)
        times = {}
        for n in (short, long):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                generate(chosen, n)
                best = min(best, time.perf_counter() - start)
            times[n] = best
        out[b] = max((times[long] - times[short]) / (long - short), 1e-6)
        print(f"[profile] batch {b}: {out[b] * 1e3:.1f} ms per step", flush=True)
    return out


def _timing_lines(path: str | None) -> int:
    if not path:
        return 0
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _median_pass(path: str | None, skip: int, kind: str) -> float | None:
    """Median seconds of the ``kind`` passes a ``DraftTimings`` file got after line ``skip``."""
    import statistics

    try:
        with open(path or "") as f:
            lines = f.read().splitlines()[skip:]
    except FileNotFoundError:  # no drafter wrote any (plain AR)
        return None
    seconds = [float(line.split()[2]) for line in lines if line.split()[0] == kind]
    return statistics.median(seconds) if seconds else None


def context_steps(generate: Generate, prompt: Sequence[int], contexts: Sequence[int],
                  short: int = 4, long: int = 20, repeats: int = 2,
                  timings: str | None = None) -> list[dict[str, Any]]:
    """For each context length ``L``: one request whose prompt is the last ``L`` tokens of
    ``prompt``. Whole-step seconds ``(t(long) - t(short)) / (steps(long) - steps(short))``,
    each ``t`` the least of ``repeats`` timed calls, steps = the engine's verify steps
    (spec-decode counter ``drafts``), or generated tokens - 1 for plain AR (one token a
    step after the prefill's). With ``timings`` (the drafter's ``$DIFFSPEC_DRAFT_TIMINGS``
    file): the median draft (and drafter-timed verify) pass of those calls too."""
    if not 0 < short < long:
        raise ValueError(f"need 0 < short < long, got {short}, {long}")
    rows = []
    for length in contexts:
        if length > len(prompt):
            raise ValueError(f"context {length} is longer than the prompt ({len(prompt)} "
                             f"tokens): pass a longer text")
        ids = list(prompt[-length:])
        mark = _timing_lines(timings)
        best: dict[int, tuple[float, int]] = {}
        for n in (short, long):
            for _ in range(repeats):
                start = time.perf_counter()
                outs, stats = generate([ids], n)
                seconds = time.perf_counter() - start
                steps = int(stats.get("drafts", 0)) or max(len(outs[0]) - 1, 0)
                if n not in best or seconds < best[n][0]:
                    best[n] = (seconds, steps)
        (t_short, s_short), (t_long, s_long) = best[short], best[long]
        step = max(t_long - t_short, 1e-6) / max(s_long - s_short, 1)
        rows.append({"context": length, "step_s": step, "steps": s_long,
                     "draft_s": _median_pass(timings, mark, "draft"),
                     "verify_s": _median_pass(timings, mark, "verify")})
        print(f"[context] {length} tokens: {step * 1e3:.1f} ms per step", flush=True)
    return rows


def system_tokens_per_s(completions: Sequence[dict[str, Any]], prompts: Sequence[list[int]],
                        concurrency: Sequence[int],
                        serve_wave: Callable[[list[list[int]]], int]) -> dict[int, float]:
    """System tokens/s by concurrency, for a worker's ``"serve"`` mode: at 1 from the
    ``completions`` served one at a time (their ``token_ids`` and ``latency_s``), at each
    c > 1 the prompts served in waves of c (``serve_wave(prompts) -> output tokens``)."""
    tokens = sum(len(c["token_ids"]) for c in completions)
    system = {1: tokens / sum(c["latency_s"] for c in completions)}
    for c in concurrency:
        if c <= 1:
            continue
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), c):
            tokens += serve_wave(list(prompts[i:i + c]))
        system[c] = tokens / (time.perf_counter() - start)
    return system


def run_job(mode: str, generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    """A worker job's ``mode``: ``"waves"``, ``"set_waves"``, ``"steps"`` or ``"context"``
    (after one warm-up call)."""
    if mode == "set_waves":
        generate([list(job["sets"][0]["prompts"][0])], 4)  # warm-up
        return {"rows": set_waves(generate, job["sets"], job["max_tokens"],
                                  job.get("waves_per_concurrency", 2), job.get("min_prompts", 4),
                                  job.get("rows_file"))}
    generate([list(job["prompts"][0])], 4)  # warm-up
    if mode == "waves":
        return {"waves": waves(generate, job["prompts"], job["concurrency"], job["repeats"],
                               job["max_tokens"], job.get("waves_per_concurrency", 2),
                               job.get("min_prompts", 4))}
    if mode == "steps":
        return {"step_s": step_times(generate, job["prompts"], job["batch_sizes"],
                                     job.get("short", 4), job.get("long", 20),
                                     job.get("step_repeats", 2))}
    if mode == "context":
        import os

        return {"context": context_steps(generate, job["long_prompt"], job["contexts"],
                                         job.get("short", 4), job.get("long", 20),
                                         job.get("step_repeats", 2),
                                         os.environ.get("DIFFSPEC_DRAFT_TIMINGS"))}
    raise ValueError(f"unknown job mode {mode!r} (serve, waves, set_waves, steps, context)")


def run_each(job: dict[str, Any], start: Callable[[dict[str, Any]], Any],
             serve: Callable[[Any, dict[str, Any]], dict[str, Any]],
             batch: Callable[[Any], Generate],
             stop: Callable[[Any], None] = lambda engine: None) -> dict[str, Any]:
    """A worker's loop: each of ``job["runs"]`` in turn on an engine of its own (``start(run)``,
    ``stop(engine)`` after it), measured by ``serve(engine, run)`` (mode ``"serve"``) or by
    :func:`run_job` on ``batch(engine)``. A run that fails becomes ``{"error": ...}`` (its
    traceback on stderr) and the others still run; ``RUN_MARKER`` on stderr opens each
    run's log."""
    mode = job.get("mode", "serve")  # serve | waves | set_waves | steps | context
    runs: dict[str, Any] = {}
    for run in job["runs"]:
        engine = None
        print(f"{RUN_MARKER}{run['name']}", file=sys.stderr, flush=True)
        try:  # one failing baseline (e.g. a drafter a CPU engine cannot run) must not stop the rest
            engine = start(run)
            runs[run["name"]] = (serve(engine, run) if mode == "serve"
                                 else run_job(mode, batch(engine), job))
        except Exception as e:  # noqa: BLE001 - reported in the run's row
            runs[run["name"]] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"run {run['name']} failed:\n{traceback.format_exc()}", file=sys.stderr)
        finally:
            if engine is not None:
                stop(engine)
        del engine
        gc.collect()
    return runs
