"""vLLM registration (entry point ``vllm.general_plugins: diffspec``).

vLLM loads general plugins in every process it starts (API server, engine core,
workers), so :func:`register` is idempotent. It refuses unsupported vLLM versions, then
registers diffspec's model architectures as lazy ``"module:Class"`` strings.
"""

from __future__ import annotations

import logging

from diffspec.plugin.versions import check_engine_version

logger = logging.getLogger("diffspec")

# Architecture name (config.json "architectures") -> "module:Class". Empty until the
# vLLM model executors land (see the README's status table).
MODEL_ARCHITECTURES: dict[str, str] = {}

_registered = False


def register() -> None:
    """Register diffspec with the running vLLM. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import vllm

    check_engine_version("vllm", vllm.__version__)
    if MODEL_ARCHITECTURES:
        from vllm import ModelRegistry

        for arch, target in MODEL_ARCHITECTURES.items():
            if arch not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(arch, target)
    _registered = True
    logger.info(
        "diffspec plugin loaded into vLLM %s (architectures: %s)",
        vllm.__version__,
        ", ".join(MODEL_ARCHITECTURES) or "none yet",
    )
