"""KV-cache helpers shared by the reference models and the reference decoder (below both).

The reference path keeps KV in a transformers ``DynamicCache``; a step rolls it back by
moving its length, never by copying (the engines do the same with their slot tables).
"""

from __future__ import annotations

__all__ = ["restore_rows", "rollback_kv", "save_rows"]


def rollback_kv(cache, length: int) -> None:
    """Roll the KV cache back to ``length`` tokens by moving its length (no copy)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers >= 5: a negative count removes that many tokens


def save_rows(cache, rows) -> list[tuple]:
    """Copies of the K/V of the batch rows ``rows`` ([batch] bool), layer by layer, for
    :func:`restore_rows`."""
    return [(layer.keys[rows].clone(), layer.values[rows].clone()) for layer in cache.layers]


def restore_rows(cache, saved: list[tuple], rows) -> None:
    """Write back K/V saved by :func:`save_rows` for the same ``rows``; the cache must hold
    as many tokens as it did then."""
    for layer, (keys, values) in zip(cache.layers, saved, strict=True):
        if layer.keys.shape[-2] != keys.shape[-2]:
            raise ValueError(f"the cache holds {layer.keys.shape[-2]} tokens, the saved rows "
                             f"{keys.shape[-2]}")
        layer.keys[rows] = keys
        layer.values[rows] = values
