"""SGLang offline worker: a script run by ``sglang_offline.py`` with SGLang's interpreter
(SGLang pins its own torch, so it lives in its own environment).

    SGLANG_PYTHON benchmarks/adapters/sglang_worker.py JOB_JSON

JOB_JSON: {"model": path, "runs": [{"name": str, "engine": {sglang.Engine kwargs}}],
"prompts": [[token ids]], "max_tokens": N, "concurrency": [1, 2, ...], "ignore_eos": bool}.
Each run starts one ``sglang.Engine`` (one after the other), warms it up, serves the prompts
one at a time, streaming (TTFT = first chunk), reading SGLang's own per-request counters
from ``meta_info`` (``spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_correct_drafts_histogram``), then for every concurrency c > 1 serves them in
batches of c. Prints one JSON line after RESULT_PREFIX, in the form of ``vllm_worker.py``'s.
With ``"mode": "waves"`` or ``"steps"`` in the job, each run does that loop of ``sweep.py``.
A run with ``"count_forwards"`` (SGLang's dLLM mode, which has no per-request forward
counter) also records each concurrency-1 request's model forwards, counted in the
scheduler process (:mod:`diffspec.testing.sglang_forwards`).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from diffspec.serving import spec_decode_counters_from_sglang
from diffspec.testing.sglang_forwards import (
    FORWARD_COUNT_ENV,
    forward_counts,
    install_forward_counter,
)

RESULT_PREFIX = "DIFFSPEC_BENCH_RESULT "
RUN_MARKER = "DIFFSPEC_BENCH_RUN "


def _params(max_tokens: int, ignore_eos: bool) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": ignore_eos}


def _one(engine, ids: list[int], params: dict, counts: str | None = None) -> dict:
    """One streamed request: its token ids, latency, TTFT and spec counters (and, with a
    ``counts`` folder, its model forwards)."""
    before = forward_counts(counts) if counts else None
    start = time.perf_counter()
    ttft, chunks = None, []
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        if ttft is None and chunk.get("output_ids"):
            ttft = time.perf_counter() - start
        chunks.append(chunk)
    latency = time.perf_counter() - start
    meta = chunks[-1]["meta_info"]
    total = meta["completion_tokens"]
    last = list(chunks[-1]["output_ids"])
    # streamed output ids are cumulative unless the server streams increments
    token_ids = last if len(last) == total else [t for c in chunks for t in c["output_ids"]]
    counters = spec_decode_counters_from_sglang(meta)
    out = {"token_ids": token_ids, "latency_s": latency, "ttft_s": ttft,
           "drafts": int(counters.drafts), "draft_tokens": int(counters.draft_tokens),
           "accepted": int(counters.accepted), "per_pos": counters.accepted_per_pos}
    if counts:  # every forward mode the request ran (prefill blocks included)
        after = forward_counts(counts)
        out["forwards"] = sum(n - before.get(m, 0) for m, n in after.items()
                              if m != "EMBED" and not m.startswith("tokens:"))
        out["forward_tokens"] = sum(n - before.get(m, 0) for m, n in after.items()
                                    if m.startswith("tokens:"))
    return out


def _serve(engine, prompts: list[list[int]], max_tokens: int, concurrency: list[int],
           ignore_eos: bool, counts: str | None = None) -> dict:
    params = _params(max_tokens, ignore_eos)
    engine.generate(input_ids=prompts[0], sampling_params=_params(4, False))  # warm-up
    completions = [_one(engine, ids, params, counts) for ids in prompts]
    # accepted drafts per position, from each request's histogram of accepted drafts
    per_pos: list[int] = []
    for c in completions:
        request_per_pos = c.pop("per_pos")
        per_pos += [0] * (len(request_per_pos) - len(per_pos))
        for pos, accepted in enumerate(request_per_pos):
            per_pos[pos] += int(accepted)
    tokens = sum(len(c["token_ids"]) for c in completions)
    system = {1: tokens / sum(c["latency_s"] for c in completions)}
    for c in concurrency:
        if c <= 1:
            continue
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), c):
            outs = engine.generate(input_ids=prompts[i:i + c],
                                   sampling_params=[params] * len(prompts[i:i + c]))
            tokens += sum(o["meta_info"]["completion_tokens"] for o in outs)
        system[c] = tokens / (time.perf_counter() - start)
    return {"completions": completions, "system_tokens_per_s": system, "accepted_per_pos": per_pos}


def _batch(engine):
    """The sweep loops' ``generate`` (:mod:`benchmarks.adapters.sweep`) on ``engine``."""
    def generate(prompts: list[list[int]], max_tokens: int):
        outs = engine.generate(input_ids=prompts,
                               sampling_params=[_params(max_tokens, True)] * len(prompts))
        totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
        for o in outs:
            counters = spec_decode_counters_from_sglang(o["meta_info"])
            totals["drafts"] += int(counters.drafts)
            totals["draft_tokens"] += int(counters.draft_tokens)
            totals["accepted"] += int(counters.accepted)
        return [list(o["output_ids"]) for o in outs], totals
    return generate


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    mode = job.get("mode", "serve")  # serve | waves | steps (benchmarks/adapters/sweep.py)
    import sglang

    runs = {}
    for run in job["runs"]:
        engine = None
        print(f"{RUN_MARKER}{run['name']}", file=sys.stderr, flush=True)
        counts = tempfile.mkdtemp(prefix="diffspec-forwards-") if run.get("count_forwards") \
            else None
        try:  # one failing baseline must not stop the rest
            if counts:  # inherited by the engine's (spawned) scheduler process
                os.environ[FORWARD_COUNT_ENV] = counts
            try:
                engine = sglang.Engine(model_path=job["model"], **run["engine"])
            finally:
                os.environ.pop(FORWARD_COUNT_ENV, None)
            if mode == "serve":
                runs[run["name"]] = _serve(engine, job["prompts"], job["max_tokens"],
                                            job["concurrency"], job.get("ignore_eos", False),
                                            counts)
            else:
                sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
                from benchmarks.adapters.sweep import run_job

                runs[run["name"]] = run_job(mode, _batch(engine), job)
        except Exception as e:  # noqa: BLE001 - reported in the run's row
            runs[run["name"]] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"run {run['name']} failed:\n{traceback.format_exc()}", file=sys.stderr)
        finally:
            if engine is not None:
                engine.shutdown()
        del engine
        gc.collect()
    print(RESULT_PREFIX + json.dumps({"runs": runs, "engine_version": sglang.__version__}),
          flush=True)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(FORWARD_COUNT_ENV):
    install_forward_counter(os.environ[FORWARD_COUNT_ENV])
