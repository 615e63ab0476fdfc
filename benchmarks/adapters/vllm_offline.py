"""vLLM offline adapter: every baseline served by ``vllm.LLM`` in one subprocess
(``vllm_worker.py``), greedy, fp32. Acceptance comes from vLLM's own spec-decode counters
(``llm.get_metrics()``), read before and after each request at concurrency 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.metrics import Completion, RunResult

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
BASE_KWARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "seed": 0,
                               "enforce_eager": True, "block_size": 32}
SELF_SPEC = ("orthrus", "linear_self_spec")  # diffspec's vLLM methods: draft + verify forwards


def speculative_config(baseline: str, num_draft_tokens: int,
                       eagle3_drafter: str | None = None) -> dict[str, Any] | None:
    """The ``speculative_config`` of a baseline (None: plain AR)."""
    if baseline == "ar":
        return None
    if baseline == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_draft_tokens,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if baseline == "eagle3":
        if not eagle3_drafter:
            raise ValueError("baseline eagle3 needs --eagle3-drafter PATH")
        return {"method": "eagle3", "model": eagle3_drafter,
                "num_speculative_tokens": num_draft_tokens}
    if baseline in SELF_SPEC:
        return {"method": baseline, "num_speculative_tokens": num_draft_tokens}
    raise ValueError(f"vLLM baseline {baseline!r} unknown "
                     f"(ar, ngram, eagle3, {', '.join(SELF_SPEC)})")


def llm_kwargs(baseline: str, num_draft_tokens: int, max_model_len: int,
               eagle3_drafter: str | None = None) -> dict[str, Any]:
    """The exact ``vllm.LLM`` keyword arguments of a baseline (recorded in the report)."""
    kwargs = {**BASE_KWARGS, "max_model_len": max_model_len}
    spec = speculative_config(baseline, num_draft_tokens, eagle3_drafter)
    return kwargs if spec is None else {**kwargs, "speculative_config": spec}


def run(baselines: list[str], model: str | Path, prompts: list[list[int]], max_tokens: int,
        num_draft_tokens: int, concurrency: list[int], max_model_len: int = 512,
        eagle3_drafter: str | None = None, timeout_s: int = 1800,
        ignore_eos: bool = False) -> list[RunResult]:
    """Serve ``prompts`` with each baseline (one engine start each, in one subprocess)."""
    runs = [{"name": b, "llm": llm_kwargs(b, num_draft_tokens, max_model_len, eagle3_drafter)}
            for b in baselines]
    job = {"model": str(model), "runs": runs, "prompts": prompts, "max_tokens": max_tokens,
           "concurrency": concurrency, "ignore_eos": ignore_eos}
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, str(WORKER), str(job_file)], capture_output=True,
                              text=True, timeout=timeout_s, check=False,
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE":
                                   os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    from benchmarks.adapters.vllm_worker import RESULT_PREFIX

    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        errors = [l for l in proc.stdout.splitlines() if " ERROR " in l][-40:]
        raise RuntimeError("vLLM worker failed:\n" + "\n".join(errors) + proc.stderr[-4000:])
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    out = []
    for run_ in runs:
        r = result["runs"][run_["name"]]
        baseline = run_["name"]
        completions = [Completion(**c) for c in r["completions"]]
        notes = [(f"vllm {result['vllm_version']} offline (vllm.LLM); concurrency c > 1: the "
                 "prompts in waves of c generate() calls")]
        if baseline in SELF_SPEC:
            for c in completions:  # one verify step = verify + draft forwards
                c.forwards = 2 * c.drafts
            notes.append("TPF = tokens / (2 x verify steps) from the spec-decode counters")
        elif baseline == "ar":
            for c in completions:  # one forward per token; as in the reference decoder, the
                c.forwards = len(c.token_ids)  # forward yielding the first token counts
        else:
            notes.append("TPF n/a: steps without an n-gram / EAGLE draft are not counted")
        out.append(RunResult(
            engine="vllm", baseline=baseline,
            launch={"vllm.LLM": {"model": str(model), **run_["llm"]},
                    "SamplingParams": {"temperature": 0.0, "ignore_eos": ignore_eos}},
            completions=completions,
            system_tokens_per_s={int(c): v for c, v in r["system_tokens_per_s"].items()},
            accepted_per_pos=r["accepted_per_pos"],
            forwards_per_step=2 if baseline in SELF_SPEC else 1, notes=notes))
    return out
