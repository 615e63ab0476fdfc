"""The benchmarks' PNGs: matplotlib on its file-only backend, each figure saved one way."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no display), or None when matplotlib
    is not installed (the benchmark then writes its tables without the PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path, *, dpi: int = 100,
         rect: tuple[float, float, float, float] | None = None) -> Path:
    """Lay ``fig`` out (``rect``: the part of the figure the axes may use, leaving room for a
    caption), write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
