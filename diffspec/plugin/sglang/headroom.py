"""Hook: SGLang's ``req_to_token`` row headroom covers the KV window its scheduler reserves
for diffspec's speculative algorithms.

SGLang reserves ``2 * W`` KV slots per request past the committed length before every
speculative decode step (``get_alloc_reserve_per_decode``: a double buffer for overlap
scheduling) and writes their slot ids into the request's ``req_to_token`` row, whose width
is the context length plus ``get_req_to_token_extra_context_len()``. That headroom is
``4 + W`` unless the page size is above 1 or the algorithm is UNO (SGLang PR #26972
widened it to the reserve there). With page size 1 and ``W > 7`` a request that runs to
the context end (SGLang lets it reach ``context_len - 2`` tokens) has ``committed + 2 W``
past the row's end, and the reservation writes out of the row. This AROUND hook returns
``max(SGLang's headroom, reserve + page_size - 1)``, PR #26972's rule, for diffspec's
speculative algorithms only; every other launch gets SGLang's value unchanged.
"""

from __future__ import annotations

from diffspec.plugin.sglang.config import self_spec_algorithms
from diffspec.plugin.sglang.hooks import register_around

__all__ = ["register_headroom"]


def register_headroom() -> None:
    """Register the AROUND hook (idempotent); SGLang's ``load_plugins()`` applies it."""
    register_around("headroom", _extra_context_len)


def _extra_context_len(original) -> int:
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_page_size,
        get_alloc_reserve_per_decode,
    )
    from sglang.srt.runtime_context import get_spec

    extra = original()
    algorithm = get_spec().speculative_algorithm
    if algorithm is None or str(algorithm).upper() not in self_spec_algorithms():
        return extra
    return max(extra, get_alloc_reserve_per_decode() + get_alloc_page_size() - 1)
