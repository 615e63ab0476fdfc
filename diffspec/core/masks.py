"""Attention masks for every view diffspec runs, as pure functions of sizes.

Convention for every mask here: a boolean tensor, ``True`` = "the query row may attend
to the key column". Rows are queries, columns are keys. :func:`to_additive_mask` turns
one into the 0 / -inf bias that SDPA-style kernels add to the scores.

Each rule is stated once in its docstring, in words, and the unit tests rebuild it
element by element from those words (``tests/unit/test_masks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "block_causal_mask",
    "block_diffusion_mask",
    "block_diffusion_training_mask",
    "orthrus_dual_pass_mask",
    "quadratic_branch_indices",
    "quadratic_mask",
    "quadratic_num_tokens",
    "to_additive_mask",
]


def to_additive_mask(
    mask: torch.Tensor,  # [..., q_len, kv_len] bool
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., q_len, kv_len]
    """0 where ``mask`` is True, -inf where it is False (an additive attention bias).

    A row with no True entry becomes all -inf, which softmax turns into NaN; none of the
    masks in this module has such a row.
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill(~mask, float("-inf"))


def block_diffusion_mask(
    prefix_len: int, block_len: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """[block_len, prefix_len + block_len]: one block over a cached causal prefix.

    Every block token sees the whole cached prefix and every token of its own block
    (no causal mask inside the block). The keys are ``[prefix cache, block]``. This is
    the diffusion view of Orthrus (block ``[anchor, <mask> x (K-1)]``), the NLD draft
    pass and the Fast-dLLM prefix-cache step. Nothing is masked, so the tensor is all
    True; it exists so that callers state the layout instead of passing ``None``.
    """
    _check_nonnegative(prefix_len=prefix_len, block_len=block_len)
    return torch.ones(block_len, prefix_len + block_len, dtype=torch.bool, device=device)


def block_causal_mask(
    seq_len: int,
    block_size: int,
    prefix_len: int = 0,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[seq_len, seq_len]: full-sequence block diffusion (clean stream, or block-wise prefill).

    Tokens before ``prefix_len`` form a causal prefix (i sees j iff j <= i). The rest is
    cut into blocks of ``block_size`` starting at ``prefix_len`` (the last one may be
    short). A block token sees the whole prefix, every earlier block and its own block
    in both directions: i sees j iff block(j) <= block(i). The prefix never sees a block.

    ``prefix_len=0`` is the rule of Fast-dLLM v2 (``eval_block_diff_mask`` and the
    clean-to-clean part of its training mask) and of NLD's ``block_diff`` paradigm:
    blocks aligned at absolute position 0, the prompt included. A ``prefix_len > 0``
    gives NLD's diffusion mode with ``causal_context=True`` (causal prompt prefill, then
    blocks that start right after the prompt).
    """
    _check_nonnegative(seq_len=seq_len, prefix_len=prefix_len)
    _check_positive(block_size=block_size)
    # Each prefix token is its own (negative-numbered) block, so one comparison covers
    # both the causal prefix and the block-causal rest.
    idx = torch.arange(seq_len, device=device)
    rel = idx - prefix_len
    block = torch.where(rel < 0, rel, torch.div(rel, block_size, rounding_mode="floor"))
    return block[None, :] <= block[:, None]


def block_diffusion_training_mask(
    seq_len: int, block_size: int, *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """BD3-LM training mask over ``[x_t (noisy), x_0 (clean)]``, as Fast-dLLM v2 and NLD train.

    Returns ``(mask [2L, 2L], position_ids [2L])`` with L = ``seq_len``; both halves use
    positions ``0 .. L-1``. With block(k) = k // block_size inside each half:

    * noisy i sees noisy j iff block(j) == block(i) (bidirectional inside its block);
    * noisy i sees clean j iff block(j) < block(i) (the clean past, as the cache holds it);
    * clean i sees clean j iff block(j) <= block(i) (:func:`block_causal_mask`);
    * clean never sees noisy.
    """
    _check_nonnegative(seq_len=seq_len)
    _check_positive(block_size=block_size)
    idx = torch.arange(2 * seq_len, device=device)
    clean = idx >= seq_len
    block = torch.div(idx % max(seq_len, 1), block_size, rounding_mode="floor")
    q_block, k_block = block[:, None], block[None, :]
    q_clean, k_clean = clean[:, None], clean[None, :]
    noisy_noisy = ~q_clean & ~k_clean & (k_block == q_block)
    noisy_clean = ~q_clean & k_clean & (k_block < q_block)
    clean_clean = q_clean & k_clean & (k_block <= q_block)
    positions = idx % max(seq_len, 1)
    return noisy_noisy | noisy_clean | clean_clean, positions


def orthrus_dual_pass_mask(
    seq_len: int,
    anchor_positions: Sequence[int] | torch.Tensor,  # [n] or [batch, n]
    block_size: int,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthrus dual-pass training mask over ``[clean sequence (L), n noisy blocks (n*K)]``.

    Block b is ``[x_a, <mask> x (K-1)]`` for anchor a = ``anchor_positions[b]``, with
    positions ``a .. a+K-1``. The rule:

    * clean i sees clean j iff j <= i (AR view); clean tokens never see a block;
    * a block token sees clean j iff j < a (strictly before its anchor: that is what the
      KV cache holds at inference, the anchor itself is not in it yet);
    * a block token sees every token of its own block (bidirectional), never another block.

    Checked against the official code (``build_diffusion_block_mask`` in chiennv's
    ``src/models/*qwen3_5.py``: AR keys ``kv_idx < anchors[b]``, diffusion keys
    block-diagonal), which runs the clean rows as a separate causal pass; here they are
    the first L rows, so ``mask[L:]`` is exactly the official diffusion-query mask.
    The official sampler draws anchors in ``1 .. L-K``; any ``0 <= a < L`` is accepted here.

    Returns ``(mask [..., L+n*K, L+n*K], position_ids [..., L+n*K])``; a 2-D
    ``anchor_positions`` adds the batch dimension.
    """
    _check_nonnegative(seq_len=seq_len)
    _check_positive(block_size=block_size)
    anchors = torch.as_tensor(anchor_positions, dtype=torch.long, device=device)
    if anchors.dim() not in (1, 2):
        raise ValueError(f"anchor_positions must be [n] or [batch, n], got {tuple(anchors.shape)}")
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= seq_len):
        raise ValueError(f"anchor positions must lie in [0, {seq_len}), got {anchors.tolist()}")
    batched = anchors.dim() == 2
    anchors = anchors if batched else anchors[None]  # [batch, n]
    num_blocks = anchors.shape[1]
    total = seq_len + num_blocks * block_size
    dev = anchors.device

    idx = torch.arange(total, device=dev)
    is_block = idx >= seq_len
    block_id = torch.div(idx - seq_len, block_size, rounding_mode="floor").clamp(min=0)
    offset = (idx - seq_len) % block_size
    q, k = idx[:, None], idx[None, :]
    qb, kb = is_block[:, None], is_block[None, :]

    clean_clean = ~qb & ~kb & (k <= q)  # [total, total]
    same_block = qb & kb & (block_id[:, None] == block_id[None, :])
    # Anchor of each row (clean rows read a padding 0 and ignore it): [batch, total]
    padded = torch.cat([anchors, anchors.new_zeros(anchors.shape[0], 1)], dim=1)
    row_anchor = padded[:, block_id]
    block_clean = qb & ~kb & (k < row_anchor[:, :, None])  # [batch, total, total]
    mask = clean_clean | same_block | block_clean

    positions = torch.where(is_block, row_anchor + offset, idx)  # [batch, total]
    if not batched:
        return mask[0], positions[0]
    return mask, positions


def quadratic_num_tokens(num_drafts: int, block_size: int) -> int:
    """Number of new tokens in the quadratic layout: (n+1) verify tokens + (n+1) branches."""
    return (num_drafts + 1) * (1 + block_size)


def quadratic_mask(
    prefix_len: int,
    num_drafts: int,
    block_size: int,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TiDAR / NLD quadratic layout: verify last step's drafts and pre-draft every branch.

    The new tokens follow a cached causal prefix of ``prefix_len`` tokens:

    * first the n+1 *verify tokens* ``t_0 .. t_n = [anchor, d_1 .. d_n]`` (n =
      ``num_drafts``): the anchor (last committed token, not in cache) and last step's
      drafts. t_i has position ``prefix_len + i`` and sees the prefix and t_0 .. t_i
      (causal), so its logits are the AR verify logits;
    * then one *branch* per acceptance outcome a = 0 .. n: ``block_size`` mask tokens with
      positions ``prefix_len+a+1 .. prefix_len+a+block_size`` that see the prefix,
      t_0 .. t_a and their own branch (bidirectional), never another branch.

    Branch a pre-drafts the continuation in case exactly a drafts are accepted (t_0 ..
    t_a committed); the verify logit of t_a gives that outcome's recovered/bonus token,
    which lands on the branch's first position. The anchor is always committed, so its
    branch is the "accept zero drafts" branch and the cached prefix's last token needs
    no block of its own: n+1 branches cover all n+1 outcomes.

    NLD (``sbd_inference_diffusion_quadratic`` / ``self_spec_generate``) uses the same
    visibility and position ids but interleaves the layout (``[t_i, <mask> x B]`` per
    sub-block, positions ``clean_len+i .. clean_len+i+B``, as REFERENCE.md says, with
    n+1 = B sub-blocks of B masks); its first draft token is the anchor, accepted
    unconditionally. Ours is a permutation of theirs (same mask, same positions) that
    keeps the verify tokens first, so committing a accepted tokens keeps the first a+1
    new KV entries and rolls back by moving the length (NLD instead gathers every
    (B+1)-th key). NLD then replaces the branch's first logit by t_a's causal logit.

    Returns ``(mask [T, prefix_len + T], position_ids [T])``, T =
    :func:`quadratic_num_tokens`; keys are ``[prefix cache, new tokens]``.
    """
    _check_nonnegative(prefix_len=prefix_len, num_drafts=num_drafts)
    _check_positive(block_size=block_size)
    num_verify = num_drafts + 1
    total = quadratic_num_tokens(num_drafts, block_size)
    idx = torch.arange(total, device=device)
    is_branch = idx >= num_verify
    rel = (idx - num_verify).clamp(min=0)
    # Verify token i "owns" prefix t_0..t_i; branch a owns t_0..t_a: [total]
    owner = torch.where(is_branch, torch.div(rel, block_size, rounding_mode="floor"), idx)
    offset = rel % block_size

    qb, kb = is_branch[:, None], is_branch[None, :]
    sees_verify = ~kb & (idx[None, :] <= owner[:, None])  # key t_j with j <= owner(q)
    same_branch = qb & kb & (owner[:, None] == owner[None, :])
    new_part = sees_verify | same_branch  # [total, total]
    prefix_part = torch.ones(total, prefix_len, dtype=torch.bool, device=idx.device)
    mask = torch.cat([prefix_part, new_part], dim=1)

    positions = prefix_len + torch.where(is_branch, owner + 1 + offset, idx)
    return mask, positions


def quadratic_branch_indices(
    num_accepted: int | torch.Tensor,  # scalar or [batch]
    num_drafts: int,
    block_size: int,
) -> torch.Tensor:  # [block_size] or [batch, block_size]
    """Indices (into the new tokens of :func:`quadratic_mask`) of branch ``num_accepted``.

    The branch's logits pre-draft the next step after ``num_accepted`` drafts were
    accepted; the verify token that precedes it is at index ``num_accepted``.
    """
    _check_nonnegative(num_drafts=num_drafts)
    _check_positive(block_size=block_size)
    accepted = torch.as_tensor(num_accepted, dtype=torch.long)
    if accepted.numel() and (int(accepted.min()) < 0 or int(accepted.max()) > num_drafts):
        raise ValueError(f"num_accepted must lie in [0, {num_drafts}], got {accepted.tolist()}")
    start = num_drafts + 1 + accepted * block_size
    return start[..., None] + torch.arange(block_size, device=accepted.device)


def _check_nonnegative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
