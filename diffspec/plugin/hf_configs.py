"""transformers config classes for the ``model_type`` names of checkpoints that the
published repos ship as remote code, so diffspec serves them with ``trust_remote_code``
off: ``orthrus`` (a Qwen3 config) and ``nemotron_labs_diffusion`` (a Ministral3 config).
Extra keys (``block_size``, ``mask_token_id``, ...) stay attributes of the config.

They are registered with transformers' own ``AutoConfig.register`` from the engine
plugins' ``register()``; the classes live at module level so a pickled config (vLLM sends
it to its engine-core process) unpickles anywhere diffspec is installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from transformers import AutoConfig, Ministral3Config, Qwen3Config

__all__ = ["NemotronLabsDiffusionConfig", "OrthrusConfig", "register_model_types"]


class OrthrusConfig(Qwen3Config):
    """Orthrus checkpoints whose config.json says ``model_type: "orthrus"``."""

    model_type = "orthrus"


class NemotronLabsDiffusionConfig(Ministral3Config):
    """Nemotron-Labs-Diffusion: a Ministral3 backbone (``model_type:
    "nemotron_labs_diffusion"``)."""

    model_type = "nemotron_labs_diffusion"


def register_model_types(model_types: Mapping[str, str]) -> None:
    """``AutoConfig.register`` each ``model_type -> "module:Class"``; idempotent."""
    for model_type, target in model_types.items():
        module, name = target.split(":")
        config_class = getattr(importlib.import_module(module), name)
        AutoConfig.register(model_type, config_class, exist_ok=True)
