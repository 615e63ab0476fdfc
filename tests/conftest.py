"""Test tiers: tests/unit -> `unit`, tests/engine -> `engine`, tests/gpu -> `gpu`.

The tier marker is added from the folder, so a test cannot land in no tier. `gpu` tests
are skipped (with the reason) when CUDA is not available.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = ("unit", "engine", "gpu")


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
