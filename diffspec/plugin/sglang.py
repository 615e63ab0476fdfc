"""SGLang registration (entry point ``sglang.srt.plugins: diffspec``).

SGLang loads plugins once per process (server, scheduler, detokenizer, data-parallel
workers), so :func:`register` is idempotent. It refuses unsupported SGLang versions, then
registers diffspec's model architectures in SGLang's model registry.
"""

from __future__ import annotations

import logging

from diffspec.plugin.versions import check_engine_version

logger = logging.getLogger("diffspec")

# Architecture name -> "module:Class". Empty until the SGLang model executors land.
MODEL_ARCHITECTURES: dict[str, str] = {}

_registered = False


def register() -> None:
    """Register diffspec with the running SGLang. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import importlib
    from importlib.metadata import version

    check_engine_version("sglang", version("sglang"))
    if MODEL_ARCHITECTURES:
        from sglang.srt.models.registry import ModelRegistry

        for arch, target in MODEL_ARCHITECTURES.items():
            module_name, _, cls_name = target.partition(":")
            ModelRegistry.models.setdefault(arch, getattr(importlib.import_module(module_name), cls_name))
    _registered = True
    logger.info(
        "diffspec plugin loaded into SGLang %s (architectures: %s)",
        version("sglang"),
        ", ".join(MODEL_ARCHITECTURES) or "none yet",
    )
