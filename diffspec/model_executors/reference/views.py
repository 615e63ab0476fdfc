"""The block view: one forward of a block of tokens on top of the committed KV cache.

Every self-speculative method drafts with the same call: run a block (``[anchor, <mask> x
(K-1)]`` at inference, several noisy blocks at training) through a stock transformers causal
LM, attending to the KV cache of the committed tokens (the AR KV) and to the block under a
given attention mask, then roll the cache back to its committed length. What differs per
method is only *which weights* run (Orthrus swaps in its diffusion attention projections,
NLD turns its LoRA on) and *how logits become drafts* (shifted or not); those live in
:mod:`diffspec.model_executors.reference.orthrus` and :mod:`diffspec.model_executors.reference.nld`.

How the mask reaches the model (transformers 5.19, Qwen3 and Ministral3): the decoder's
``create_causal_mask`` returns a 4-D ``attention_mask`` unchanged
(``masking_utils._preprocess_mask_arguments``: "If the mask is already 4D, simply return
as-is"), and both the SDPA and the eager attention add it to the scores. So the block mask
is passed as an additive ``[batch, 1, n, cache_len + n]`` bias (0 = attend, dtype minimum
= blocked), which is the one form both implementations accept; SDPA's ``is_causal`` is
only used when the mask is ``None``, so the bias is what is applied. The keys are
``[cache (committed tokens), block]`` in that order, because the cache's ``update``
appends the block's K/V before attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffspec.core.kv import rollback_kv

__all__ = ["SUPPORTED_ATTENTION", "anchor_block", "block_view_logits"]

SUPPORTED_ATTENTION = ("sdpa", "eager")  # implementations that apply a custom 4-D bias


def anchor_block(
    anchor: int, mask_token_id: int, cache_len: int, num_masks: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:  # input_ids [num_masks + 1], position_ids [num_masks + 1]
    """The inference block ``[anchor, <mask> x num_masks]`` at positions ``cache_len ..
    cache_len + num_masks`` (the anchor is the last committed token, not yet in the cache)."""
    ids = torch.full((num_masks + 1,), mask_token_id, dtype=torch.long, device=device)
    ids[0] = anchor
    return ids, torch.arange(cache_len, cache_len + num_masks + 1, device=device)


def block_view_logits(
    model: torch.nn.Module,
    input_ids: Tensor,  # [n] or [batch, n]
    position_ids: Tensor,  # [n] or [batch, n] absolute positions (any order, may repeat)
    cache=None,  # DynamicCache of the committed tokens (cache_len), or None (no prefix)
    attention_mask: Tensor | None = None,  # [n, cache_len + n] or [batch, n, ...] bool
    keep_kv: bool = False,
) -> Tensor:  # [n, vocab] or [batch, n, vocab]
    """Logits of a block run on top of ``cache`` under ``attention_mask``.

    ``attention_mask`` is boolean, ``True`` = the query row may attend to the key column,
    with keys ``[cache, block]``; ``None`` means every block token sees the whole cache and
    the whole block (bidirectional, :func:`diffspec.core.masks.block_diffusion_mask`). The
    block's K/V are appended to the cache for the forward; unless ``keep_kv`` the cache is
    then rolled back to its previous length by moving the length (``DynamicCache.crop``),
    never by copying the prefix. Gradients flow (no ``no_grad`` here), so training calls
    this too, e.g. with rows of :func:`diffspec.core.masks.orthrus_dual_pass_mask`.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"block_view_logits needs attn_implementation in {SUPPORTED_ATTENTION} "
                         f"(a custom 4-D mask), got {impl!r}")
    batched = input_ids.ndim == 2
    ids = input_ids if batched else input_ids[None]  # [batch, n]
    pos = position_ids if position_ids.ndim == 2 else position_ids[None]  # [batch|1, n]
    batch, n = ids.shape
    cache_len = cache.get_seq_length() if cache is not None else 0
    if pos.shape[-1] != n:
        raise ValueError(f"position_ids has {pos.shape[-1]} positions for {n} block tokens")

    if attention_mask is None:
        attention_mask = torch.ones(n, cache_len + n, dtype=torch.bool, device=ids.device)
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool, got {attention_mask.dtype}")
    if tuple(attention_mask.shape[-2:]) != (n, cache_len + n):
        raise ValueError(f"attention_mask must be [n, cache_len + n] = [{n}, {cache_len + n}] "
                         f"(keys: cache then block), got {tuple(attention_mask.shape)}")
    mask = attention_mask.to(ids.device)
    mask = mask.expand(batch, n, cache_len + n) if mask.ndim == 2 else mask  # [batch, n, kv]
    dtype = model.get_input_embeddings().weight.dtype
    bias = torch.zeros(mask.shape, dtype=dtype, device=ids.device)
    bias = bias.masked_fill(~mask, torch.finfo(dtype).min)[:, None]  # [batch, 1, n, kv]

    out = model(input_ids=ids, position_ids=pos.expand(batch, n), attention_mask=bias,
                past_key_values=cache, use_cache=cache is not None)
    if cache is not None and not keep_kv:
        rollback_kv(cache, cache_len)
    return out.logits if batched else out.logits[0]
