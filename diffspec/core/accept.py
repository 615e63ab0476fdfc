"""Accept rules: which draft tokens a verify pass accepts, and the one token it adds.

Design notes: docs/design/core.md (section ``diffspec/core/accept.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diffspec.core import PLACEHOLDER_TOKEN_ID
from diffspec.core.sampling import sample_from_probs

__all__ = [
    "AcceptOutput",
    "coupled_accept",
    "greedy_accept",
    "rejection_sample_accept",
    "truncate_at_stop",
]


@dataclass
class AcceptOutput:
    """The result of one accept step for a batch of requests."""

    # [batch, max_num_drafts + 1] int64: accepted drafts, then the recovered or bonus
    # token, then PLACEHOLDER_TOKEN_ID (-1).
    output_token_ids: Tensor
    num_accepted: Tensor  # [batch] int64: accepted draft tokens per request (0 .. draft_lens[b])

    @property
    def num_emitted(self) -> Tensor:  # [batch] int64
        """Tokens emitted per request: the accepted drafts plus the recovered / bonus token."""
        return self.num_accepted + 1

    def tokens(self, b: int) -> list[int]:
        """The emitted tokens of request ``b``."""
        return self.output_token_ids[b, : int(self.num_accepted[b]) + 1].tolist()


# ------------------------------------------------------------------------------ helpers


def _draft_lens(
    draft_token_ids: Tensor,  # [batch, max_num_drafts]
    draft_lens: Tensor | None,  # [batch] or None
    vocab_size: int,
) -> Tensor:  # [batch] int64
    """Validate the drafts and return each request's draft length."""
    if draft_token_ids.ndim != 2:
        raise ValueError(
            f"draft_token_ids must have shape [batch, max_num_drafts], "
            f"got {tuple(draft_token_ids.shape)}"
        )
    if draft_token_ids.dtype.is_floating_point or draft_token_ids.dtype == torch.bool:
        raise ValueError(f"draft_token_ids must be an integer tensor, got {draft_token_ids.dtype}")
    batch, n = draft_token_ids.shape
    positions = torch.arange(n, device=draft_token_ids.device)  # [max_num_drafts]
    if draft_lens is None:
        present = draft_token_ids != PLACEHOLDER_TOKEN_ID
        lens = present.sum(dim=1)
        if not torch.equal(present, positions < lens.unsqueeze(1)):
            raise ValueError(
                "draft_token_ids: the non-placeholder (-1) entries of each row must form a "
                "prefix when draft_lens is not given"
            )
    else:
        lens = torch.as_tensor(draft_lens, device=draft_token_ids.device).long()
        if lens.shape != (batch,):
            raise ValueError(
                f"draft_lens must have shape [batch]=({batch},), got {tuple(lens.shape)}"
            )
        if batch and bool(((lens < 0) | (lens > n)).any()):
            raise ValueError(f"draft_lens must lie in [0, max_num_drafts={n}], got {lens.tolist()}")
    valid = positions < lens.unsqueeze(1)
    ids = draft_token_ids[valid]
    if ids.numel() and bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise ValueError(f"draft token ids within draft_lens must lie in [0, vocab={vocab_size})")
    return lens


def _check_target(
    name: str, target: Tensor, batch: int, n: int, vocab: int | None = None
) -> None:
    """``target`` must be ``[batch, n + 1, vocab]``."""
    if target.ndim != 3 or target.shape[0] != batch or target.shape[1] != n + 1:
        raise ValueError(
            f"{name} must have shape [batch, max_num_drafts + 1, vocab] = "
            f"[{batch}, {n + 1}, vocab], got {tuple(target.shape)}"
        )
    if vocab is not None and target.shape[2] != vocab:
        raise ValueError(f"{name} has vocab {target.shape[2]}, expected {vocab}")


def _assemble(
    draft_token_ids: Tensor,  # [batch, max_num_drafts]
    num_accepted: Tensor,  # [batch]
    final_token_ids: Tensor,  # [batch] the recovered or bonus token
) -> AcceptOutput:
    """Lay out accepted drafts, then the final token, then placeholders."""
    batch, n = draft_token_ids.shape
    device = draft_token_ids.device
    num_accepted = num_accepted.to(torch.int64)
    padded = torch.cat(
        [draft_token_ids.long(), torch.full((batch, 1), PLACEHOLDER_TOKEN_ID, device=device)], dim=1
    )  # [batch, max_num_drafts + 1]
    positions = torch.arange(n + 1, device=device)
    out = torch.where(positions < num_accepted.unsqueeze(1), padded, PLACEHOLDER_TOKEN_ID)
    out = out.scatter(1, num_accepted.unsqueeze(1), final_token_ids.long().unsqueeze(1))
    return AcceptOutput(output_token_ids=out, num_accepted=num_accepted)


def _prefix_len(accept: Tensor) -> Tensor:  # accept [batch, n] bool -> [batch] int64
    """Length of the all-True prefix of each row."""
    return torch.cumprod(accept.long(), dim=1).sum(dim=1)


# -------------------------------------------------------------------------------- rules


def greedy_accept(
    draft_token_ids: Tensor,  # [batch, max_num_drafts] int64, -1 past each draft
    target_logits: Tensor,  # [batch, max_num_drafts + 1, vocab]
    draft_lens: Tensor | None = None,  # [batch] int64; None => count of non -1 (a prefix)
) -> AcceptOutput:
    """Accept the longest prefix where the draft equals the target argmax; then emit the
    target argmax at the first mismatch (recovered) or at position ``draft_lens[b]`` (bonus).
    """
    batch, n = draft_token_ids.shape if draft_token_ids.ndim == 2 else (-1, -1)
    lens = _draft_lens(draft_token_ids, draft_lens, target_logits.shape[-1])
    _check_target("target_logits", target_logits, batch, n)
    target_ids = target_logits.argmax(dim=-1)  # [batch, max_num_drafts + 1]
    valid = torch.arange(n, device=lens.device) < lens.unsqueeze(1)  # [batch, max_num_drafts]
    num_accepted = _prefix_len(valid & (draft_token_ids == target_ids[:, :n]))
    final = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _assemble(draft_token_ids, num_accepted, final)


def rejection_sample_accept(
    draft_token_ids: Tensor,  # [batch, max_num_drafts] int64, -1 past each draft
    draft_probs: Tensor | None,  # [batch, max_num_drafts, vocab]; None => point-mass drafts
    target_probs: Tensor,  # [batch, max_num_drafts + 1, vocab], already processed
    draft_lens: Tensor | None = None,  # [batch] int64; None => count of non -1 (a prefix)
    generators: torch.Generator | Sequence[torch.Generator] | None = None,
) -> AcceptOutput:
    """Speculative rejection sampling (lossless for any draft distribution ``q``).

    Draft ``j`` is accepted with probability ``min(1, p(d_j) / q(d_j))``. At the first
    rejection a recovered token is drawn from ``normalize(max(p - q, 0))``, or from ``p``
    when that residual has no positive mass (``p == q`` numerically). When all drafts pass,
    the bonus token is drawn from ``target_probs[b, draft_lens[b]]``. ``draft_probs=None``
    means point-mass drafts, ``q = one-hot(d)``, which engines use when the drafter gives no
    probabilities. A draft with ``q(d) == 0`` cannot have been drawn from ``q``; it is
    treated as rejected (and the recovered token drawn from the residual as usual).

    Randomness: ``generators`` is ``None`` (global RNG), one generator for the batch, or one
    per request. With one per request, request ``b`` draws ``draft_lens[b]`` uniforms and then
    ``vocab`` exponentials from its own generator, so its output does not depend on the
    rest of the batch. Generators must live on the inputs' device.
    """
    batch, n = draft_token_ids.shape if draft_token_ids.ndim == 2 else (-1, -1)
    vocab = target_probs.shape[-1]
    lens = _draft_lens(draft_token_ids, draft_lens, vocab)
    _check_target("target_probs", target_probs, batch, n)
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, n, vocab):
        raise ValueError(
            f"draft_probs must have shape [batch, max_num_drafts, vocab] = [{batch}, {n}, "
            f"{vocab}] or be None, got {tuple(draft_probs.shape)}"
        )
    per_request = generators is not None and not isinstance(generators, torch.Generator)
    if per_request and len(generators) != batch:  # type: ignore[arg-type]
        raise ValueError(f"generators must be None, one torch.Generator, or {batch} generators, "
                         f"got {len(generators)}")  # type: ignore[arg-type]
    device = target_probs.device
    p = target_probs.float()
    draft = draft_token_ids.long().clamp_min(0)  # placeholders -> 0; masked out below
    valid = torch.arange(n, device=device) < lens.unsqueeze(1)  # [batch, max_num_drafts]

    # Uniforms for the accept tests.
    if per_request:
        uniform = torch.ones(batch, n, device=device)  # >= any ratio => rejected if unused
        for b, gen in enumerate(generators):  # type: ignore[arg-type]
            n_b = int(lens[b])
            uniform[b, :n_b] = torch.rand(n_b, generator=gen, device=device)
    else:
        uniform = torch.rand(batch, n, generator=generators, device=device)

    p_draft = p[:, :n].gather(2, draft.unsqueeze(2)).squeeze(2)  # [batch, max_num_drafts]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(2, draft.unsqueeze(2)).squeeze(2)
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-30), torch.zeros_like(p_draft))
    num_accepted = _prefix_len(valid & (uniform < ratio))  # u < ratio: prob min(1, ratio)

    # The distribution of the final token: the residual at a rejection, p at the bonus.
    rows = torch.arange(batch, device=device)
    p_final = p[rows, num_accepted]  # [batch, vocab]
    rejected = (num_accepted < lens).unsqueeze(1)  # [batch, 1]
    at = num_accepted.clamp_max(max(n - 1, 0))
    if n == 0:
        q_final = torch.zeros_like(p_final)
    elif draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter(1, draft[rows, at].unsqueeze(1), 1.0)
    else:
        q_final = draft_probs.float()[rows, at]
    residual = torch.where(rejected, (p_final - q_final).clamp_min(0), p_final)
    mass = residual.sum(dim=1, keepdim=True)
    final_probs = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)

    if per_request:
        final = torch.cat([
            sample_from_probs(final_probs[b : b + 1], gen)
            for b, gen in enumerate(generators)  # type: ignore[arg-type]
        ]) if batch else torch.zeros(0, dtype=torch.int64, device=device)
    else:
        final = sample_from_probs(final_probs, generators)
    return _assemble(draft_token_ids, num_accepted, final)


def coupled_accept(
    draft_token_ids: Tensor,  # [batch, max_num_drafts] int64, -1 past each draft
    target_logits: Tensor,  # [batch, max_num_drafts + 1, vocab] processed logits
    noise: Tensor,  # [batch, max_num_drafts + 1, vocab] position_gumbel_noise per row
    draft_lens: Tensor | None = None,  # [batch] int64; None => count of non -1 (a prefix)
) -> AcceptOutput:
    """Greedy acceptance on ``log_softmax(target_logits) + noise`` (coupled sampling).

    With ``noise[b, j] = position_gumbel_noise(seed_b, [pos_b + j], vocab)`` the emitted
    tokens are exactly those seeded AR decoding with :func:`coupled_sample` would emit at the
    same positions. Like :func:`coupled_sample`, the per-row ``log_softmax`` shift is
    dropped: it does not change the argmax.
    """
    if noise.shape != target_logits.shape:
        raise ValueError(
            f"noise must have the shape of target_logits {tuple(target_logits.shape)}, "
            f"got {tuple(noise.shape)}"
        )
    perturbed = target_logits.float() + noise.to(device=target_logits.device, dtype=torch.float32)
    return greedy_accept(draft_token_ids, perturbed, draft_lens)


def truncate_at_stop(
    token_ids: Sequence[int] | Tensor,  # [num_tokens]
    stop_token_ids: Iterable[int],
) -> int:
    """How many tokens to keep: through the first stop token, else all of them."""
    if isinstance(token_ids, Tensor):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        ids = token_ids.tolist()
    else:
        ids = list(token_ids)
    stops = set(stop_token_ids)
    for i, token in enumerate(ids):
        if token in stops:
            return i + 1
    return len(ids)
