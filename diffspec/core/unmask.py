"""Confidence-threshold parallel unmasking (Fast-dLLM; NLD diffusion mode), pure tensor rules.

One step of block diffusion decoding: the diffusion view predicts every position of the
block; among the still-masked positions, those whose predicted token is confident
enough are committed, and always at least the most confident one, so that every step
makes progress. ``threshold >= 1.0`` therefore commits exactly one token per step (the
most confident), the one-token-per-step reference.

Comparison rule: a position passes when its confidence is *strictly greater* than the
threshold, as in Fast-dLLM v2 (``unmask_idx = x1_p > threshold`` plus the row argmax)
and NLD's linear self-spec. Fast-dLLM v1 (``llada/generate.py: get_transfer_index``)
drops a candidate only when ``confidence < threshold``, i.e. it keeps ``>=``; the two
differ only on exact ties with the threshold, and strict ``>`` is what makes
``threshold = 1.0`` one token per step even when a probability rounds to exactly 1.
"""

from __future__ import annotations

import torch

__all__ = ["confidence_unmask", "shift_logits", "sub_block_start", "unmask_block"]


def shift_logits(
    logits: torch.Tensor,  # [batch, block, vocab]
    prev_logits: torch.Tensor | None = None,  # [batch, 1, vocab]
) -> torch.Tensor:  # [batch, block, vocab]
    """Align next-token logits with the positions they predict (Dream / Fast-dLLM v2 / Orthrus).

    A causal-style head at position j predicts the token at j+1. After the shift, entry
    j holds the logits *for* position j: ``out[:, j] = logits[:, j-1]`` for j >= 1. The
    block's first position has no predictor inside the block; it gets ``prev_logits``
    (the last logit before the block, as NLD's Dream-style path does) or, when that is
    not given, a copy of ``logits[:, 0]`` (Fast-dLLM v2 and Orthrus:
    ``cat(logits[:, :1], logits[:, :-1])``), which is harmless because the first
    position (the anchor) is never masked. LLaDA-style heads (LLaDA, NLD by default)
    are unshifted and must not go through this.
    """
    first = logits[:, :1] if prev_logits is None else prev_logits
    return torch.cat([first, logits[:, :-1]], dim=1)


def confidence_unmask(
    logits: torch.Tensor,  # [batch, block, vocab], aligned: entry j predicts canvas[:, j]
    canvas: torch.Tensor,  # [batch, block] int64, mask_token_id where still masked
    mask_token_id: int,
    threshold: float,
    *,
    min_tokens: int = 1,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Fast-dLLM unmasking step: ``(new_canvas [batch, block], unmasked [batch, block])``.

    Per row: predict x0 at every position (argmax, or a sample from
    ``softmax(logits / temperature)`` when ``temperature > 0``) with confidence = the
    probability of x0 under that same distribution. Among masked positions, commit
    every one with confidence > ``threshold`` and, in any case, the ``min_tokens`` most
    confident ones (fewer if fewer are masked). Ties in confidence go to the lower index.
    Positions that are not masked never change; a row with nothing masked is returned
    as is. ``unmasked`` marks the positions committed by this step.
    """
    if logits.dim() != 3 or canvas.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [batch, block, vocab] and canvas [batch, block]; "
            f"got {tuple(logits.shape)} and {tuple(canvas.shape)}"
        )
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")

    is_masked = canvas == mask_token_id  # [batch, block]
    scores = logits.float()
    if temperature > 0:
        probs = torch.softmax(scores / temperature, dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        x0 = torch.multinomial(flat, 1, generator=generator).view(canvas.shape)
    else:
        probs = torch.softmax(scores, dim=-1)
        x0 = probs.argmax(dim=-1)  # first maximal index on ties
    confidence = probs.gather(-1, x0.unsqueeze(-1)).squeeze(-1)  # [batch, block]
    confidence = confidence.masked_fill(~is_masked, float("-inf"))

    # Rank positions by confidence, stable so that ties keep index order.
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )
    quota = is_masked.sum(dim=-1, keepdim=True).clamp(max=min_tokens)  # [batch, 1]
    selected = is_masked & ((confidence > threshold) | (rank < quota))

    new_canvas = torch.where(selected, x0.to(canvas.dtype), canvas)
    return new_canvas, selected


def unmask_block(
    logits: torch.Tensor,  # [n, block, vocab] as the head computes them (row j at slot j)
    canvas: torch.Tensor,  # [n, block] int64, mask_token_id where masked
    limit: torch.Tensor,  # [n] int64: slots from here are past max_tokens, never decoded
    mask_token_id: int,
    threshold: float,
    *,
    sub_block: int | None = None,  # decode only the first sub-block with masked slots
    shifted: bool = False,  # slot j reads row j - 1 (Dream, Fast-dLLM v2)
    start: torch.Tensor | None = None,  # [n] int64: slots before it are prompt, never decoded
) -> tuple[torch.Tensor, torch.Tensor]:  # (canvas [n, block], committed [n, block] bool)
    """One Fast-dLLM step on a batch of blocks, each row on its own: among the masked
    slots in ``[start, limit)`` of the row's current sub-block (the first one with such
    slots), commit every one whose confidence exceeds ``threshold``, and at least the most
    confident one (:func:`confidence_unmask`); the mask token is never a prediction. The
    engines' per-row form of the reference decoder's step (``vllm`` and ``sglang``
    Fast-dLLM workers)."""
    scores = logits.float().clone()
    scores[..., mask_token_id] = float("-inf")  # the mask token is never a prediction
    if shifted:
        scores = shift_logits(scores)
    block = canvas.shape[1]
    idx = torch.arange(block, device=canvas.device)
    work = (canvas == mask_token_id) & (idx[None] < limit[:, None])
    if start is not None:
        work &= idx[None] >= start[:, None]
    if sub_block is not None and sub_block < block:
        c0 = sub_block_start(work, sub_block)
        work &= (idx[None] >= c0[:, None]) & (idx[None] < c0[:, None] + sub_block)
    candidates = torch.where(work, mask_token_id, -1)  # only the slots to decode are masked
    tokens, committed = confidence_unmask(scores, candidates, mask_token_id, threshold)
    return torch.where(committed, tokens, canvas), committed


def sub_block_start(work: torch.Tensor, sub_block: int) -> torch.Tensor:  # [n] int64
    """First slot of each row's current sub-block: the sub-block (of ``sub_block`` slots,
    aligned to the block) holding the row's first slot with work (``work``: [n, block]
    bool); 0 for a row without work."""
    first = torch.where(work.any(1), work.int().argmax(1), 0)  # [n] first slot with work
    return first // sub_block * sub_block
