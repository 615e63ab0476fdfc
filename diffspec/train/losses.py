"""Drafter losses: pure functions on logits, shared by the Orthrus and NLD trainers.

Every function takes the drafter's (**student**) logits and the AR view's (**teacher**)
logits for the same ``N`` draft positions, flattened to ``[N, vocab]``, plus optional
per-position ``weights [N]`` (0 drops a position). A weighted loss is the weighted mean
over positions, so a batch's loss does not depend on how many positions it supervises.

* :func:`forward_kl`: KL(teacher || student), the Orthrus objective (and EAGLE's, DFlash's);
* :func:`lk_loss`: ``-log sum_v min(p_v, q_v)``, the negative log of the probability that a
  draft sampled from the student passes rejection sampling against the teacher (the
  "LK" loss of Samarin et al. 2026, arXiv:2602.23881: it targets acceptance directly);
* :func:`token_cross_entropy`: CE on given target ids (the true next tokens, or the
  teacher's greedy tokens);
* :func:`accepted_prefix_weights`: 1 on the positions a greedy verify would look at
  (the accepted prefix and the first rejected position), 0 after: what linear
  self-speculation is trained on, since drafts after the first rejection are never used;
* :func:`draft_loss`: the combination both trainers use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DraftLoss",
    "accepted_prefix_weights",
    "draft_loss",
    "forward_kl",
    "lk_loss",
    "token_cross_entropy",
    "weighted_mean",
]

Divergence = Literal["kl", "lk"]


def weighted_mean(values: Tensor, weights: Tensor | None = None) -> Tensor:
    """Mean of ``values [N]`` weighted by ``weights [N]`` (0 when every weight is 0)."""
    if weights is None:
        return values.mean() if values.numel() else values.sum()
    weights = weights.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp_min(1e-8)


def forward_kl(
    student_logits: Tensor,  # [N, vocab]
    teacher_logits: Tensor,  # [N, vocab]
    weights: Tensor | None = None,  # [N]
    temperature: float = 1.0,
) -> Tensor:  # scalar
    """KL(teacher || student) per position, weighted mean; scaled by T^2 so that the
    gradient magnitude does not depend on the temperature. No gradient to the teacher."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    per_position = (teacher.exp() * (teacher - student)).sum(-1)  # [N]
    return weighted_mean(per_position, weights) * temperature**2


def lk_loss(
    student_logits: Tensor,  # [N, vocab]
    teacher_logits: Tensor,  # [N, vocab]
    weights: Tensor | None = None,  # [N]
) -> Tensor:  # scalar
    """``-log sum_v min(p_v, q_v)`` per position (p teacher, q student), weighted mean.

    ``sum_v min(p, q) = 1 - TV(p, q)`` is the acceptance probability of a sampled draft
    under rejection sampling; the log keeps its gradient from vanishing when the overlap
    is small (a plain TV loss barely trains a fresh drafter).
    """
    q = F.softmax(student_logits.float(), dim=-1)
    p = F.softmax(teacher_logits.detach().float(), dim=-1)
    overlap = torch.minimum(p, q).sum(-1).clamp_min(1e-8)  # [N]
    return weighted_mean(-overlap.log(), weights)


def token_cross_entropy(
    student_logits: Tensor,  # [N, vocab]
    target_ids: Tensor,  # [N] int64
    weights: Tensor | None = None,  # [N]
) -> Tensor:  # scalar
    """Cross entropy of ``target_ids`` under the student, weighted mean."""
    per_position = F.cross_entropy(student_logits.float(), target_ids, reduction="none")
    return weighted_mean(per_position, weights)


def accepted_prefix_weights(
    draft_ids: Tensor,  # [..., n] int64: the drafter's greedy tokens
    target_ids: Tensor,  # [..., n] int64: the AR view's greedy tokens
) -> Tensor:  # [..., n] float: 1 up to and including the first mismatch, 0 after
    """Accepted-prefix-plus-one weights of each block (rows along the last dimension).

    With ``k`` = the number of leading positions where the draft equals the target (what
    greedy acceptance accepts), positions ``0 .. k`` get weight 1 (``k`` is the first
    rejected position, where the recovered token comes from); the rest get 0, since a
    verify never looks at them. A fully accepted block is weighted everywhere.
    """
    if draft_ids.shape != target_ids.shape:
        raise ValueError(f"shapes differ: {tuple(draft_ids.shape)} vs {tuple(target_ids.shape)}")
    match = (draft_ids == target_ids).long()
    accepted_before = torch.cumprod(match, dim=-1)  # 1 while every position so far matched
    # position j is looked at iff every position before it matched
    looked_at = torch.cat([torch.ones_like(match[..., :1]), accepted_before[..., :-1]], dim=-1)
    return looked_at.float()


@dataclass
class DraftLoss:
    """The terms of :func:`draft_loss` (``total`` is what is back-propagated)."""

    total: Tensor  # scalar
    divergence: Tensor  # scalar, detached
    cross_entropy: Tensor  # scalar, detached
    accuracy: Tensor  # scalar, detached: weighted share of drafts equal to the teacher's argmax

    def as_tensors(self) -> dict[str, Tensor]:
        """The terms by name (a plain dict, which DDP / FSDP can return from a forward)."""
        return {
            "loss": self.total,
            "divergence": self.divergence,
            "ce": self.cross_entropy,
            "draft_acc": self.accuracy,
        }


def draft_loss(
    student_logits: Tensor,  # [N, vocab]
    teacher_logits: Tensor,  # [N, vocab]
    *,
    weights: Tensor | None = None,  # [N]
    target_ids: Tensor | None = None,  # [N] int64; default: the teacher's argmax
    divergence: Divergence = "kl",
    divergence_weight: float = 1.0,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
) -> DraftLoss:
    """``divergence_weight * (KL or LK) + ce_weight * CE``, all with the same weights."""
    if divergence == "kl":
        div = forward_kl(student_logits, teacher_logits, weights, temperature)
    elif divergence == "lk":
        div = lk_loss(student_logits, teacher_logits, weights)
    else:
        raise ValueError(f"divergence must be 'kl' or 'lk', got {divergence!r}")
    targets = teacher_logits.argmax(-1) if target_ids is None else target_ids
    ce = token_cross_entropy(student_logits, targets, weights)
    total = divergence_weight * div + (ce_weight * ce if ce_weight else 0.0)
    hits = (student_logits.detach().argmax(-1) == teacher_logits.argmax(-1)).float()
    return DraftLoss(total, div.detach(), ce.detach(), weighted_mean(hits, weights))
