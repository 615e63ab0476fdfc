"""KV-cache helpers shared by the reference models and the reference decoder (below both).

The reference path keeps KV in a transformers ``DynamicCache``; a step rolls it back by
moving its length, never by copying (the engines do the same with their slot tables).
"""

from __future__ import annotations

__all__ = ["rollback_kv"]


def rollback_kv(cache, length: int) -> None:
    """Roll the KV cache back to ``length`` tokens by moving its length (no copy)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers >= 5: a negative count removes that many tokens
