"""ReFusion slot rules (layout, plan, verify, reorder) as pure functions.

Design notes: docs/design/core.md (section ``diffspec/core/slots.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from diffspec.core import PLACEHOLDER_TOKEN_ID

__all__ = [
    "SlotOrder",
    "committed_slot_lengths",
    "first_stop_in_slots",
    "longest_layout",
    "reorder_for_kv_reuse",
    "score_slots",
    "select_slots",
    "slot_layout",
    "verify_slot_drafts",
    "width_error",
]


def slot_layout(max_tokens: int, slot_size: int, num_blocks: int) -> tuple[int, int | None]:
    """A request's generation layout: ``(gen_len, block_len)``, ``max_tokens`` rounded up
    to whole slots and the length of each of the ``num_blocks`` serial blocks it splits
    into; ``block_len`` is ``None`` when those blocks would not be whole slots (ReFusion
    cannot decode the request)."""
    gen_len = math.ceil(max_tokens / slot_size) * slot_size
    if gen_len % num_blocks or (gen_len // num_blocks) % slot_size:
        return gen_len, None
    return gen_len, gen_len // num_blocks


def longest_layout(width: int, slot_size: int, num_blocks: int) -> int:
    """The most tokens a request may ask for within ``width`` generated positions that
    :func:`slot_layout` splits (a multiple of ``slot_size * num_blocks``; 0 when none fits):
    a request's default ``max_tokens`` when the client sends none."""
    step = slot_size * num_blocks
    return width // step * step


def width_error(width: object, slot_size: int, num_blocks: int, name: str) -> str | None:
    """Why ``width`` (a launch's most generated tokens a request may have, called ``name``
    in the message) cannot hold ReFusion's generations (first words: what to do), or
    ``None``: it must be whole slots and hold at least one :func:`slot_layout`."""
    if isinstance(width, bool) or not isinstance(width, int) or width < slot_size \
            or width % slot_size:
        return (f"set {name} to a multiple of slot_size {slot_size} (the most tokens a "
                f"request may generate), got {width!r}")
    if not longest_layout(width, slot_size, num_blocks):
        return (f"raise {name} to at least slot_size x num_blocks = {slot_size * num_blocks} "
                f"(or lower num_blocks): a request's generation is that many serial blocks of "
                f"whole slots, got {width}")
    return None


def score_slots(
    first_logits: torch.Tensor,  # [..., num_slots, vocab]: logits at each slot's first position
    is_masked: torch.Tensor | None = None,  # [..., num_slots] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan score of each slot: the max probability at its first position.

    Returns ``(scores [..., num_slots], first_tokens [..., num_slots])``: the softmax
    probability of the most likely first token, and that token. Slots that are not
    masked (``is_masked`` False) score -inf so that :func:`select_slots` never picks them.
    """
    probs = torch.softmax(first_logits.float(), dim=-1)
    scores, tokens = probs.max(dim=-1)
    if is_masked is not None:
        scores = scores.masked_fill(~is_masked, float("-inf"))
    return scores, tokens


def select_slots(
    scores: torch.Tensor,  # [..., num_slots], -inf for slots that cannot be chosen
    slot_threshold: float,
) -> torch.Tensor:  # [..., num_slots] bool
    """Choose the slots to infill: every score > ``slot_threshold``, else the top-1.

    The fallback picks the highest score (the lowest index on ties) and only among
    finite scores, so a row with no selectable slot selects nothing.
    """
    selected = scores > slot_threshold
    best = scores.argmax(dim=-1, keepdim=True)  # first maximal index on ties
    top1 = torch.zeros_like(selected).scatter_(-1, best, True)
    top1 &= torch.isfinite(scores)
    none_passed = ~selected.any(dim=-1, keepdim=True)
    return selected | (top1 & none_passed)


def verify_slot_drafts(
    draft_token_ids: torch.Tensor,  # [num_slots, slot_len] int64, PLACEHOLDER_TOKEN_ID padded
    token_probs: torch.Tensor,  # [num_slots, slot_len]: causal-pass probability of each draft
    token_threshold: float,
    num_accepted: torch.Tensor | None = None,  # [num_slots]: accepted before this pass (0)
) -> torch.Tensor:  # [num_slots] int64
    """New number of accepted tokens per slot after one causal verify pass.

    ``token_probs[s, i]`` is the probability the verify pass gives token i of slot s,
    given the context and tokens 0 .. i-1 of that slot. A slot keeps its first
    ``num_accepted`` tokens (0 at the plan's global verification), then the token at the
    first open position, unconditionally: it is the model's own choice there (the plan's
    for a slot's first token, the draft pass's later), so every pass makes progress;
    then the longest run of drafts after it with probability strictly over
    ``token_threshold``. ``token_probs`` at positions ``<= num_accepted`` are ignored.
    Acceptance stops at the first placeholder (-1).
    """
    if draft_token_ids.shape != token_probs.shape:
        raise ValueError(
            f"draft_token_ids {tuple(draft_token_ids.shape)} and token_probs "
            f"{tuple(token_probs.shape)} must have the same shape"
        )
    index = torch.arange(draft_token_ids.shape[-1], device=draft_token_ids.device)
    if num_accepted is None:
        num_accepted = torch.zeros(draft_token_ids.shape[:-1], dtype=torch.long,
                                   device=draft_token_ids.device)
    kept = index <= num_accepted[..., None]  # accepted before + the forced token
    ok = (kept | (token_probs > token_threshold)) & (draft_token_ids != PLACEHOLDER_TOKEN_ID)
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def first_stop_in_slots(
    token_ids: torch.Tensor,  # [num_slots, slot_len] int64
    num_accepted: torch.Tensor,  # [num_slots]: accepted prefix length of each slot
    stop_token_ids: Sequence[int],
) -> torch.Tensor:  # [num_slots] int64
    """Index of the first accepted stop token in each slot, ``-1`` where there is none.

    An accepted stop token ends its slot (the tokens after it are dropped) and ends the
    generation after it: the decoder commits the slots up to the first one with a stop
    and removes the masked slots that lie after it.
    """
    if not stop_token_ids:
        return torch.full_like(num_accepted, -1)
    stops = torch.as_tensor(list(stop_token_ids), dtype=token_ids.dtype, device=token_ids.device)
    index = torch.arange(token_ids.shape[-1], device=token_ids.device)
    hit = torch.isin(token_ids, stops) & (index < num_accepted[..., None])
    first = hit.long().argmax(dim=-1)  # first True, 0 when none
    return torch.where(hit.any(dim=-1), first, torch.full_like(first, -1))


def committed_slot_lengths(
    num_accepted: torch.Tensor,  # [num_slots] accepted prefix length of each slot (verify)
    stop_at: torch.Tensor,  # [num_slots] first_stop_in_slots: -1 = none
    slot_len: int,
) -> tuple[list[int], bool]:  # tokens committed from each leading slot; whether it stopped
    """What a global verify commits: the leading slots whose drafts were all accepted or
    hold an accepted stop token, up to and including the first such stop (that slot keeps
    the tokens up to its stop). ``([], False)`` when the first chosen slot is neither."""
    done = (num_accepted == slot_len) | (stop_at >= 0)
    lead = int(done.long().cumprod(0).sum())  # leading complete slots
    stops = (stop_at[:lead] >= 0).nonzero().flatten()
    if len(stops):
        lead = int(stops[0]) + 1
    keep = [slot_len] * lead
    if len(stops):
        keep[-1] = int(stop_at[lead - 1]) + 1
    return keep, bool(len(stops))


class SlotOrder(NamedTuple):
    """Token permutation for KV reuse: ``tokens[perm]`` reorders, ``reordered[inverse]`` undoes."""

    perm: torch.Tensor  # [num_tokens]: original index of each reordered token
    inverse: torch.Tensor  # [num_tokens]: reordered index of each original token
    position_ids: torch.Tensor  # [num_tokens]: true position of each reordered token


def reorder_for_kv_reuse(
    decode_step: Sequence[int] | torch.Tensor,  # [num_slots]: decode round, -1 if still masked
    slot_sizes: int | Sequence[int] | torch.Tensor,  # int, or [num_slots]
    start_position: int = 0,
) -> SlotOrder:
    """Token order that puts decoded slots before masked ones, with true position ids kept.

    Slots are laid out contiguously in their original order (slot sizes given by
    ``slot_sizes``; the first token of slot 0 has position ``start_position``). The new
    order holds the decoded slots first, sorted by the round they were decoded in (the
    order their KV entered the cache; original order breaks ties), then the masked
    slots in original order. Tokens never move inside a slot. ``position_ids`` are the
    original positions of the reordered tokens, so attention still sees the true layout.
    """
    step = torch.as_tensor(decode_step, dtype=torch.long)
    if step.dim() != 1:
        raise ValueError(f"decode_step must be 1-D, got {tuple(step.shape)}")
    num_slots = step.shape[0]
    if isinstance(slot_sizes, int):
        sizes = torch.full((num_slots,), slot_sizes, dtype=torch.long, device=step.device)
    else:
        sizes = torch.as_tensor(slot_sizes, dtype=torch.long, device=step.device)
    if sizes.shape != step.shape:
        raise ValueError(
            f"slot_sizes {tuple(sizes.shape)} must match decode_step {tuple(step.shape)}"
        )
    if num_slots and int(sizes.min()) < 1:
        raise ValueError(f"slot sizes must be >= 1, got {sizes.tolist()}")

    # Masked slots sort after every decoded one; stable sort keeps original order on ties.
    masked_key = int(step.max()) + 1 if num_slots else 0
    key = torch.where(step < 0, torch.full_like(step, masked_key), step)
    slot_order = torch.sort(key, stable=True).indices  # [num_slots]
    sorted_sizes = sizes[slot_order]
    src_starts = (torch.cumsum(sizes, dim=0) - sizes)[slot_order]  # where each slot came from
    dst_starts = torch.cumsum(sorted_sizes, dim=0) - sorted_sizes  # where it goes
    within = torch.arange(int(sizes.sum()), device=step.device) - torch.repeat_interleave(
        dst_starts, sorted_sizes
    )
    perm = torch.repeat_interleave(src_starts, sorted_sizes) + within  # [num_tokens]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return SlotOrder(perm=perm, inverse=inverse, position_ids=perm + start_position)
