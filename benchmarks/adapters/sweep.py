"""Engine-free loops of the load benchmarks, shared by ``vllm_worker.py`` and
``sglang_worker.py`` (each passes its engine's batch call): a concurrency sweep in waves
(:func:`waves`) and AR step times by batch size (:func:`step_times`).

``generate(prompts, max_tokens) -> (token_ids, counters)``: the engine serves ``prompts``
(token ids) together, greedy, ``max_tokens`` each, EOS ignored, and returns each output's
token ids and the spec-decode counters of the call (``{"drafts", "draft_tokens",
"accepted"}``, zeros for plain AR).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

Generate = Callable[[list[list[int]], int], tuple[list[list[int]], dict[str, int]]]
COUNTERS = ("drafts", "draft_tokens", "accepted")


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


def run_job(mode: str, generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    """A worker job's ``mode``: ``"waves"`` or ``"steps"`` (after one warm-up call)."""
    generate([list(job["prompts"][0])], 4)  # warm-up
    if mode == "waves":
        return {"waves": waves(generate, job["prompts"], job["concurrency"], job["repeats"],
                               job["max_tokens"], job.get("waves_per_concurrency", 2),
                               job.get("min_prompts", 4))}
    if mode == "steps":
        return {"step_s": step_times(generate, job["prompts"], job["batch_sizes"],
                                     job.get("short", 4), job.get("long", 20),
                                     job.get("step_repeats", 2))}
    raise ValueError(f"unknown job mode {mode!r} (serve, waves, steps)")
