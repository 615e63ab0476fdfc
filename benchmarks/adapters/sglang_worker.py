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

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository

from benchmarks.adapters.sweep import RESULT_PREFIX, run_each, system_tokens_per_s  # noqa: E402
from diffspec.serving import spec_decode_counters_from_sglang  # noqa: E402
from diffspec.testing.sglang_forwards import (  # noqa: E402
    FORWARD_COUNT_ENV,
    forward_counts,
    install_forward_counter,
)


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

    def serve_wave(wave: list[list[int]]) -> int:
        outs = engine.generate(input_ids=wave, sampling_params=[params] * len(wave))
        return sum(o["meta_info"]["completion_tokens"] for o in outs)

    system = system_tokens_per_s(completions, prompts, concurrency, serve_wave)
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
    import sglang

    counts: dict[str, str | None] = {}  # run -> the folder its forwards are counted in

    def start(run: dict) -> sglang.Engine:
        counts[run["name"]] = folder = (tempfile.mkdtemp(prefix="diffspec-forwards-")
                                        if run.get("count_forwards") else None)
        if folder:  # inherited by the engine's (spawned) scheduler process
            os.environ[FORWARD_COUNT_ENV] = folder
        try:
            return sglang.Engine(model_path=job["model"], **run["engine"])
        finally:
            os.environ.pop(FORWARD_COUNT_ENV, None)

    def serve(engine: sglang.Engine, run: dict) -> dict:
        return _serve(engine, job["prompts"], job["max_tokens"], job["concurrency"],
                      job.get("ignore_eos", False), counts[run["name"]])

    runs = run_each(job, start, serve, _batch, stop=lambda engine: engine.shutdown())
    print(RESULT_PREFIX + json.dumps({"runs": runs, "engine_version": sglang.__version__}),
          flush=True)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and os.environ.get(FORWARD_COUNT_ENV):
    install_forward_counter(os.environ[FORWARD_COUNT_ENV])
