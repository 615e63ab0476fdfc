"""One layer's attention run as several calls of vLLM's own ``Attention`` inside one eager
forward, each with its own metadata and slot mapping (TiDAR's branches, ReFusion's
completion rows), then K/V written back to given cache slots.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/split_attention.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

import torch
from torch import nn

__all__ = ["SplitAttention", "swap_attention"]

# One attention call: (token index, this layer's metadata, its slot mapping); metadata None:
# the forward context's own (and its slot mapping).
Call = tuple[Any, Any, Any]
# K/V written back after the calls: (token index, cache slots).
WriteBack = tuple[Any, torch.Tensor]


@contextmanager
def swap_attention(model: nn.Module, wrap: Callable[[nn.Module], nn.Module]) -> Iterator[None]:
    """Swap every layer's ``self_attn.attn`` for ``wrap(attn)`` around the block (the
    originals back after it, also on an error)."""
    inner = model.model
    holders = [layer.self_attn for layer in islice(inner.layers, inner.start_layer,
                                                   inner.end_layer)]
    originals = [h.attn for h in holders]
    try:
        for holder, attn in zip(holders, originals):
            holder.attn = wrap(attn)
        yield
    finally:
        for holder, attn in zip(holders, originals):
            holder.attn = attn


class SplitAttention(nn.Module, ABC):
    """Stands in for one layer's ``Attention``: runs it once per call of :meth:`calls`, on
    that call's tokens with that call's metadata and slot mapping set in vLLM's forward
    context (restored after), then writes the K/V of the write-back tokens to their slots
    (``unified_kv_cache_update``)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "attn", attn)  # not a submodule: the layer still owns it

    @abstractmethod
    def calls(self, slot_mapping: torch.Tensor) -> tuple[list[Call], WriteBack | None]:
        """This layer's calls, in order, and its write-back; ``slot_mapping``: the forward
        context's own for this layer."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
        # query: [T, heads * head_dim]; key, value: [T, kv_heads * head_dim]
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

        attn, name = self.attn, self.attn.layer_name
        out = torch.empty((query.shape[0], attn.num_heads * attn.head_size_v),
                          dtype=query.dtype, device=query.device)
        context = get_forward_context()
        saved = context.attn_metadata[name], context.slot_mapping[name]
        calls, write_back = self.calls(saved[1])
        try:
            for index, metadata, mapping in calls:
                context.attn_metadata[name], context.slot_mapping[name] = (
                    saved if metadata is None else (metadata, mapping))
                out[index] = attn(query[index], key[index], value[index])
            if write_back is not None:
                index, slots = write_back
                context.slot_mapping[name] = slots
                unified_kv_cache_update(key[index].view(-1, attn.num_kv_heads, attn.head_size),
                                        value[index].view(-1, attn.num_kv_heads,
                                                          attn.head_size_v), name)
        finally:
            context.attn_metadata[name], context.slot_mapping[name] = saved
        return out
