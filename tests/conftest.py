"""Test tiers: tests/unit -> `unit`, tests/engine -> `engine`, tests/gpu -> `gpu`.

The tier marker is added from the folder, so a test cannot land in no tier. `gpu` tests
are skipped (with the reason) when CUDA is not available.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_TIERS = ("unit", "engine", "gpu")


def _one_core_per_worker() -> None:
    """Under pytest-xdist (``-n 2`` in pyproject.toml), give each worker's engines their
    own core: vLLM's CPU worker pins its compute thread (``VLLM_CPU_OMP_THREADS_BIND``,
    else core 0 on a 2-core machine), so two workers' engines would otherwise share one
    core and leave the other idle. Tests that bind otherwise (tensor-parallel runs) set
    their own value."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or workers < 2 or len(cpus) < workers:
        return
    core = str(cpus[int(worker[2:]) % len(cpus)])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", core)
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", core)


_one_core_per_worker()


def pytest_configure(config: pytest.Config) -> None:
    # The test models are tiny: one intra-op thread is faster than two fighting over small
    # matmuls (and far faster on a loaded machine). Engines run in their own processes.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    for item in items:
        parts = Path(str(item.fspath)).parts
        tier = next((t for t in _TIERS if t in parts), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "gpu" or item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="gpu tier: CUDA is not available"))
