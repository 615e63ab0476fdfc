"""A ReFusion checkpoint (``GSAI-ML/ReFusion``): a stock causal Qwen3 whose ``config.json``
names the ``<|mask|>`` token's id; its decoding loop is
:mod:`diffspec.spec_workers.reference.refusion`."""

from __future__ import annotations

from pathlib import Path

import torch

from diffspec.core.checkpoint import CheckpointInfo, inspect_checkpoint, require_method

__all__ = ["load_refusion"]


def load_refusion(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a ReFusion checkpoint (stock Qwen3 + ``<|mask|>``) as a transformers
    ``Qwen3ForCausalLM``; returns ``(model, info)``. Raises ``CheckpointError`` naming what
    the folder lacks (e.g. ``mask_token_id`` in config.json)."""
    from transformers import Qwen3ForCausalLM

    info: CheckpointInfo = inspect_checkpoint(path)
    require_method(info, "refusion")
    from diffspec.model_executors.reference.loading import from_pretrained_strict

    return from_pretrained_strict(Qwen3ForCausalLM, info.path, dtype=dtype), info
