"""SGLang offline adapter: every baseline served by ``sglang.Engine`` in one subprocess
(``sglang_worker.py``) of SGLang's own interpreter, greedy. Acceptance comes from SGLang's
own per-request counters (``meta_info``: ``spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_correct_drafts_histogram``). On a CPU-only machine the driver passes the test
harness's environment (``tests/engine/sglang_cpu.py``: a libcuda stub on
``LD_LIBRARY_PATH``, ``SGLANG_USE_CPU_ENGINE=1``) and the CPU engine arguments; the stub is
a test harness, never part of what users install."""

from __future__ import annotations

import argparse
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

WORKER = Path(__file__).resolve().parent / "sglang_worker.py"
ENV_RECORDED = ("SGLANG_USE_CPU_ENGINE", "OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND")
METHODS = engine_methods("sglang")
# baseline method -> SGLang --speculative-algorithm / --dllm-algorithm (the registry's SGLang
# entries; the entry's flag says which)
ALGORITHMS = {m.name: m.sglang.name for m in REGISTRY.values() if m.sglang is not None}
BASE_KWARGS: dict[str, Any] = {"random_seed": 0, "log_level": "error"}


def add_sglang_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark that starts SGLang takes: its interpreter (SGLang pins its
    own torch, so it lives in its own environment) and the CPU test harness."""
    p.add_argument("--sglang-python", default=None,
                   help="interpreter of an environment with SGLang (default: this one; with "
                   "--sglang-cpu-harness: the harness's, DIFFSPEC_SGLANG_PYTHON)")
    p.add_argument("--sglang-cpu-harness", action="store_true",
                   help="run SGLang on a CPU-only machine through the test harness "
                   "tests/engine/sglang_cpu.py (libcuda stub, CPU engine arguments; never "
                   "installed)")


def sglang_runtime(args: argparse.Namespace) -> tuple[str, dict[str, str], dict[str, Any]]:
    """From :func:`add_sglang_args`' options: the SGLang interpreter, the whole environment
    to run it in and extra engine arguments (none, or the CPU harness's: a test-tier module,
    imported only on request)."""
    if not args.sglang_cpu_harness:
        return args.sglang_python or sys.executable, dict(os.environ), {}
    try:
        from tests.engine import sglang_cpu
    except ImportError as e:
        raise SystemExit(f"--sglang-cpu-harness needs tests/engine/sglang_cpu.py ({e}): run "
                         "from a checkout") from e
    python = args.sglang_python or sglang_cpu.sglang_python()
    if python is None:
        raise SystemExit("Pass --sglang-python or set DIFFSPEC_SGLANG_PYTHON: the SGLang CPU "
                         "harness found no SGLang interpreter")
    return python, sglang_cpu.sglang_cpu_env(python), dict(sglang_cpu.SGLANG_CPU_ENGINE_KWARGS)


def engine_kwargs(b: Baseline, max_model_len: int, dtype: str = "float32",
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exact ``sglang.Engine`` keyword arguments of a baseline (recorded in the report);
    ``extra``: the CPU harness's engine arguments on a CPU-only machine. SGLang counts the
    verified root token among its draft tokens: K drafts -> K + 1."""
    kwargs = {**BASE_KWARGS, "dtype": dtype, "context_length": max_model_len, **(extra or {})}
    if b.method == "ar":
        return kwargs
    if b.method not in ALGORITHMS:
        raise ValueError(f"SGLang baseline {b.method!r} unknown (known: {', '.join(METHODS)})")
    if REGISTRY[b.method].sglang.flag == "--dllm-algorithm":  # SGLang's diffusion-LM mode
        kwargs |= {"dllm_algorithm": ALGORITHMS[b.method]}
        return kwargs | ({"dllm_algorithm_config": b.dllm_config} if b.dllm_config else {})
    kwargs |= {"speculative_algorithm": ALGORITHMS[b.method],
               "speculative_num_draft_tokens": b.num_draft_tokens + 1}
    if b.method in DRAFTER_METHODS:
        if not b.drafter:
            raise ValueError(f"baseline {b.method} needs --{b.method}-drafter PATH")
        kwargs["speculative_draft_model_path"] = b.drafter
    if b.method in SELF_SPEC:  # a fixed K, as the baseline's name says (not the
        # adaptive default), the drafter alone (no prompt lookup)
        kwargs["json_model_override_args"] = json.dumps({"diffspec": {"adaptive": False}})
    if b.method == "eagle3":  # a chain of K drafts (EAGLE-3's tree off: topk 1)
        kwargs |= {"speculative_num_steps": b.num_draft_tokens, "speculative_eagle_topk": 1}
    return kwargs


def _dllm(b: Baseline) -> bool:
    """The baseline runs in SGLang's diffusion-LM mode (``--dllm-algorithm``)."""
    method = REGISTRY.get(b.method)
    return bool(method and method.sglang and method.sglang.flag == "--dllm-algorithm")


def serve_command(model: str | Path, kwargs: dict[str, Any]) -> str:
    """The ``python -m sglang.launch_server`` command equivalent to ``sglang.Engine``."""
    parts = ["python", "-m", "sglang.launch_server", "--model-path", str(model)]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif value is not False and value is not None:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


def run(baselines: list[Baseline], model: str | Path, prompts: list[list[int]],
        max_tokens: int, concurrency: list[int], max_model_len: int = 512, *,
        python: str, env: dict[str, str] | None = None, timeout_s: int = 900,
        ignore_eos: bool = False, dtype: str = "float32",
        extra_kwargs: dict[str, Any] | None = None) -> list[RunResult]:
    """Serve ``prompts`` with each baseline (one engine, one worker process each) under
    ``python``, with ``env`` added to the environment (the CPU harness's)."""
    runs = [{"name": b.label, "engine": engine_kwargs(b, max_model_len, dtype, extra_kwargs),
             "count_forwards": _dllm(b)} for b in baselines]
    from benchmarks.adapters.sweep import RESULT_PREFIX

    results, logs, version = {}, {}, "?"
    for run_ in runs:  # one process per engine: a failing SGLang child SIGQUITs its parent
        job = {"model": str(model), "runs": [run_], "prompts": prompts,
               "max_tokens": max_tokens, "concurrency": concurrency, "ignore_eos": ignore_eos}
        with tempfile.TemporaryDirectory() as tmp:
            job_file = Path(tmp) / "job.json"
            job_file.write_text(json.dumps(job))
            try:
                proc = subprocess.run([python, str(WORKER), str(job_file)],
                                      capture_output=True, text=True, timeout=timeout_s,
                                      check=False, env={**os.environ, **(env or {})})
            except subprocess.TimeoutExpired as e:
                results[run_["name"]] = {"error": f"no result within {timeout_s} s"}
                logs[run_["name"]] = (e.stderr or b"").decode(errors="replace")
                continue
        lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
        logs[run_["name"]] = proc.stderr
        if lines:
            result = json.loads(lines[-1][len(RESULT_PREFIX):])
            version = result["engine_version"]
            results[run_["name"]] = result["runs"][run_["name"]]
        else:
            results[run_["name"]] = {"error": f"SGLang worker exited with {proc.returncode}"}
    out = []
    for b, run_ in zip(baselines, runs):
        r = results[run_["name"]]
        launch = {"sglang.Engine": {"model_path": str(model), **run_["engine"]},
                  "sampling_params": {"temperature": 0.0, "ignore_eos": ignore_eos},
                  "sglang serve": serve_command(model, run_["engine"])}
        if env:
            launch["env"] = {k: v for k, v in env.items() if k in ENV_RECORDED}
            if "LD_LIBRARY_PATH" in env:
                launch["env"]["LD_LIBRARY_PATH"] = "(+ the CPU harness's test-only libcuda stub)"
        notes = [(f"sglang {version} offline (sglang.Engine), streamed at "
                 "concurrency 1 (TTFT = first chunk); c > 1: the prompts in batches of c")]
        if "error" in r:
            causes = [l.strip() for l in logs[b.label].splitlines()
                      if "Error" in l and "py-spy" not in l
                      and not l.lstrip().startswith(("File ", "raise "))]
            error = r["error"] + "".join(f"\n{c}" for c in dict.fromkeys(causes[-6:]))
            out.append(RunResult(engine="sglang", baseline=b.label, launch=launch,
                                 completions=[], notes=notes, error=error))
            continue
        forward_tokens = [c.pop("forward_tokens", None) for c in r["completions"]]
        completions = [Completion(**c) for c in r["completions"]]
        for c in completions:  # target forwards after prefill, as for vLLM
            c.forwards = (c.forwards if _dllm(b)  # counted: every forward, prefill included
                          else len(c.token_ids) if b.method == "ar"
                          else b.forwards_per_step * c.drafts if b.method in SELF_SPEC
                          else c.drafts if c.drafts else None)
        if _dllm(b):
            notes.append("dLLM mode: TPF counts every model forward of a request (SGLang "
                         "prefills a prompt one block per forward), counted in the scheduler "
                         "process (diffspec.testing.sglang_forwards)")
            if None not in forward_tokens:
                generated = sum(len(c.token_ids) for c in completions)
                notes.append(f"dLLM mode: the forwards of the c=1 requests ran "
                             f"{sum(forward_tokens)} tokens through the model for {generated} "
                             f"generated ({sum(forward_tokens) / max(1, generated):.2f} per "
                             f"generated token, prompt blocks included)")
        out.append(RunResult(
            engine="sglang", baseline=b.label, launch=launch, completions=completions,
            system_tokens_per_s={int(c): v for c, v in r["system_tokens_per_s"].items()},
            accepted_per_pos=r["accepted_per_pos"], forwards_per_step=b.forwards_per_step,
            notes=notes))
    return out
