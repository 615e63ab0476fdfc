"""Reading an NLD checkpoint's tensors for the engines' model classes (vLLM, SGLang).

Engine-free (torch + safetensors): the published NLD layout names its backbone
``encoder.*`` and its head ``diffusion_head.*``, and ships the drafter's PEFT LoRA (o_proj
only) in ``linear_spec_lora/``. Both engines' classes load through these functions, so the
layout is read one way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from diffspec.core.checkpoint import LORA_DIR, CheckpointError, resolve_checkpoint

__all__ = ["lora_folder", "lora_rank_and_scaling", "lora_weights", "renamed_weights"]

_PREFIXES = (("encoder.", "model."), ("diffusion_head.", "lm_head."))
_PEFT_PREFIX = "base_model.model.encoder."


def renamed_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the engines' Mistral names (``model.*``, ``lm_head.*``)."""
    for name, tensor in weights:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
        yield name, tensor


def lora_weights(lora_path: Path | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The PEFT adapter's tensors under the engines' names (``...o_proj_lora_{a,b}...``)."""
    if lora_path is None:
        return
    from safetensors import safe_open

    with safe_open(str(lora_path / "adapter_model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if not key.startswith(_PEFT_PREFIX) or ".o_proj.lora_" not in key:
                raise CheckpointError(f"{lora_path}: unsupported LoRA tensor {key} "
                                      f"(NLD's drafter adapts o_proj only)")
            name = "model." + key[len(_PEFT_PREFIX):]
            name = name.replace(".o_proj.lora_A.", ".o_proj_lora_a.")
            yield name.replace(".o_proj.lora_B.", ".o_proj_lora_b."), f.get_tensor(key)


def lora_folder(model: str) -> Path | None:
    """The checkpoint's ``linear_spec_lora/`` folder, if it has one."""
    try:
        folder = resolve_checkpoint(model) / LORA_DIR
    except CheckpointError:
        return None
    return folder if folder.is_dir() else None


def lora_rank_and_scaling(folder: Path) -> tuple[int, float]:
    """The adapter's rank and ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    if list(config.get("target_modules") or []) != ["o_proj"]:
        raise CheckpointError(f"{folder}: NLD's drafter LoRA targets o_proj only, got "
                              f"target_modules={config.get('target_modules')}")
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise CheckpointError(f"{folder}: DoRA and per-module rank/alpha patterns are not "
                              f"supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
