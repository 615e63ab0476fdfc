"""vLLM registration (entry point ``vllm.general_plugins: diffspec``).

Design notes: docs/design/plugins.md (section ``diffspec/plugin/vllm/__init__.py``).
"""

from __future__ import annotations

import logging

from diffspec.methods import FAMILIES, METHODS
from diffspec.plugin.versions import check_engine_version
from diffspec.plugin.vllm.config import (
    is_self_spec_proposer,
    self_spec_methods,
    translate_speculative_config,
)

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level

__all__ = ["is_self_spec_proposer", "register", "translate_speculative_config"]

_registered = False
DIFFUSION_METHOD = "fast_dllm"  # the registry method served on vLLM's diffusion path


def register() -> None:
    """Register diffspec with the running vLLM. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import vllm

    check_engine_version("vllm", vllm.__version__)
    from vllm import ModelRegistry

    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.plugin.vllm.dllm import register_config_hooks
    from diffspec.plugin.vllm.patches import apply_all
    from diffspec.plugin.vllm.refusion import register_refusion_hook

    architectures = {}
    for family in FAMILIES.values():
        register_model_types(family.hf_configs)
        architectures.update(family.vllm_models)
    for arch, target in architectures.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
    # Fast-dLLM's checkpoints on vLLM's diffusion path (diffusion_config, V2 runner); the
    # hook leaves NLD (a causal family) alone unless --diffusion-config is given
    register_config_hooks([arch for family in METHODS[DIFFUSION_METHOD].families
                           for arch in FAMILIES[family].vllm_models])
    # ReFusion's stock Qwen3 checkpoints on the same path, with --diffusion-config only
    register_refusion_hook()
    apply_all(vllm.__version__)
    _registered = True
    logger.info(
        "diffspec plugin loaded into vLLM %s (architectures: %s; speculative methods: %s)",
        vllm.__version__,
        ", ".join(architectures),
        ", ".join(self_spec_methods()),
    )
