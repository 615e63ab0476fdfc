"""diffspec: diffusion-drafted speculative decoding for vLLM and SGLang.

Importing this package is cheap: it imports neither torch nor an engine. The
submodules are loaded on first attribute access (PEP 562 ``__getattr__``).

Layout:
    diffspec.core             engine-free math (accept / sample / unmask / slots / masks),
                              checkpoint inspection and the reference decoder (the oracle)
    diffspec.model_executors  model architectures (Orthrus, NLD, ...)
    diffspec.spec_workers     decoding methods, one file per method
    diffspec.plugin           one ``register()`` per engine (entry points)
    diffspec.testing          tiny checkpoints in the published layouts, synthetic language
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0.dev0"

_SUBMODULES = ("core", "model_executors", "spec_workers", "plugin", "testing", "cli")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES])
