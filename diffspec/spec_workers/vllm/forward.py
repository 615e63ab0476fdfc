"""The served model's own decoder layers, run eagerly: the forward diffspec's vLLM workers
run in place of vLLM's compiled one where they change what a layer's attention does (TiDAR's
quadratic step, :mod:`~diffspec.spec_workers.vllm.tidar`) or need hidden states of rows
vLLM did not schedule (ReFusion's sampler, :mod:`~diffspec.spec_workers.vllm.refusion`).
"""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn

__all__ = ["decoder_forward"]


def decoder_forward(
    inner: nn.Module,  # vLLM's *Model (Qwen3Model, LlamaModel, ...)
    input_ids: torch.Tensor,  # [N]
    positions: torch.Tensor,  # [N]
) -> torch.Tensor:  # [N, hidden]
    """The model's own layers, eagerly (bypassing the compiled ``forward``)."""
    hidden = inner.embed_input_ids(input_ids)
    residual = None
    for layer in islice(inner.layers, inner.start_layer, inner.end_layer):
        hidden, residual = layer(positions, hidden, residual)
    hidden, _ = inner.norm(hidden, residual)
    return hidden
