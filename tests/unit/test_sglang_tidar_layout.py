"""The pure helpers behind SGLang's ``--speculative-algorithm TIDAR``
(:mod:`diffspec.model_executors.sglang.quadratic`, :mod:`diffspec.plugin.sglang.config`):
token layouts, masks, positions and draft rows, checked against the reference decoder's
rules (:func:`diffspec.core.masks.quadratic_mask`, :mod:`diffspec.spec_workers.reference.tidar`).
No engine needed."""

from __future__ import annotations

import pytest
import torch

from diffspec.core.masks import quadratic_branch_indices, quadratic_mask
from diffspec.model_executors.sglang.quadratic import (
    MaskedLayout,
    branch_size,
    draft_rows,
    prefill_branch_layout,
    tokens_per_step,
    verify_step_layout,
)


@pytest.mark.parametrize(("drafts", "shift", "masks", "tokens"),
                         [(8, True, 8, 81), (7, False, 8, 72), (1, True, 1, 4), (1, False, 2, 6)])
def test_branch_size_and_tokens_per_step(drafts: int, shift: bool, masks: int, tokens: int) -> None:
    assert branch_size(drafts, shift) == masks
    assert tokens_per_step(drafts, shift) == tokens == (drafts + 1) * (1 + masks)
    with pytest.raises(ValueError):
        branch_size(0, shift)


@pytest.mark.parametrize("committed", [0, 1, 13])
@pytest.mark.parametrize(("drafts", "masks"), [(3, 3), (3, 4), (1, 2)])
def test_verify_step_layout_is_the_reference_mask_after_any_prefix(committed, drafts, masks):
    """Every step token sees the whole committed prefix; among the step's tokens the mask
    and positions are the reference's, shifted by the prefix length."""
    new_mask, offsets = verify_step_layout(drafts, masks)
    mask, positions = quadratic_mask(committed, drafts, masks)
    assert torch.equal(mask[:, :committed], torch.ones(len(offsets), committed, dtype=torch.bool))
    assert torch.equal(mask[:, committed:], new_mask)
    assert torch.equal(positions, committed + offsets)


@pytest.mark.parametrize(("prefix", "extend", "masks"),
                         [(0, 1, 3), (0, 5, 4), (7, 1, 2), (3, 6, 5)])
def test_prefill_branch_is_the_reference_bootstrap_step(prefix, extend, masks) -> None:
    """The fused prefill = the reference's uncounted prefill of all prompt tokens but the
    last, plus its first step (the anchor, i.e. the last prompt token, and branch 0): the
    last prompt row and the mask rows see exactly what ``quadratic_mask(P, 0, K')`` lets
    the anchor and branch 0 see (``P`` = prompt length - 1), at the same positions."""
    mask, positions = prefill_branch_layout(prefix, extend, masks)
    prompt_len = prefix + extend
    assert mask.shape == (extend + masks, prompt_len + masks)
    assert positions.tolist() == list(range(prefix, prompt_len + masks))
    ref_mask, ref_positions = quadratic_mask(prompt_len - 1, 0, masks)  # keys: [P, t_0, branch]
    assert torch.equal(mask[extend - 1:], ref_mask)
    assert torch.equal(positions[extend - 1:], ref_positions)
    # the prompt rows: plain causal prefill, never a mask
    for i in range(extend):
        expected = [k <= prefix + i for k in range(prompt_len)] + [False] * masks
        assert mask[i].tolist() == expected


def test_prefill_branch_layout_needs_a_prompt_token() -> None:
    with pytest.raises(ValueError):
        prefill_branch_layout(4, 0, 3)


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("drafts", [1, 3, 8])
def test_draft_rows_are_the_reference_branch_drafts(shift: bool, drafts: int) -> None:
    """Outcome ``a``'s next drafts come from branch ``a``: ``branch[skip:][:n]`` in the
    reference (``skip`` = 1 when unshifted: the bonus token's position)."""
    masks = branch_size(drafts, shift)
    rows = draft_rows(drafts, masks, shift)
    assert rows.shape == (drafts + 1, drafts)
    skip = 0 if shift else 1
    for a in range(drafts + 1):
        branch = quadratic_branch_indices(a, drafts, masks)
        assert rows[a].tolist() == branch[skip:][:drafts].tolist()
    _, offsets = verify_step_layout(drafts, masks)
    # a draft row of outcome a sits at positions C + a + 1 + skip ..., i.e. it predicts
    # (shifted: the token after) the positions after the bonus token C + a + 1
    for a in range(drafts + 1):
        first = a + 1 + skip
        assert offsets[rows[a]].tolist() == list(range(first, first + drafts))
    with pytest.raises(ValueError):
        draft_rows(drafts, masks - 1, shift)


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize(("drafts", "next_drafts"), [(0, 3), (3, 1), (2, 5)])
def test_adaptive_steps_verify_n_and_draft_m(shift: bool, drafts: int, next_drafts: int):
    """An adaptive step verifies the ``n`` drafts the last step chose and pre-drafts the
    ``m`` this step chose (``n = 0``: the anchor alone, the bootstrap step's layout):
    branches of ``m + skip`` masks, outcome ``a``'s drafts from branch ``a``."""
    masks = branch_size(next_drafts, shift)
    new_mask, offsets = verify_step_layout(drafts, masks)
    mask, positions = quadratic_mask(0, drafts, masks)
    assert torch.equal(new_mask, mask) and torch.equal(offsets, positions)
    rows = draft_rows(drafts, masks, shift, next_drafts)
    assert rows.shape == (drafts + 1, next_drafts)
    skip = 0 if shift else 1
    for a in range(drafts + 1):
        assert rows[a].tolist() == quadratic_branch_indices(a, drafts, masks)[skip:].tolist()
    with pytest.raises(ValueError):
        draft_rows(drafts, masks, shift, next_drafts + 1)


@pytest.mark.parametrize("drafts", [0, 1, 4])
def test_a_step_that_drafts_nothing_is_the_causal_verify_chain(drafts: int) -> None:
    new_mask, offsets = verify_step_layout(drafts, 0)
    assert offsets.tolist() == list(range(drafts + 1))
    assert torch.equal(new_mask, torch.ones(drafts + 1, drafts + 1, dtype=torch.bool).tril())


def test_masked_layout_checks_shapes() -> None:
    rows = [torch.arange(3)]
    with pytest.raises(ValueError):
        MaskedLayout(rows, [torch.arange(2)], [torch.ones(3, 4, dtype=torch.bool)])
    MaskedLayout(rows, [torch.arange(2)], [torch.ones(3, 5, dtype=torch.bool)])


def test_quadratic_max_drafts_is_the_reference_models() -> None:
    """What the SGLang plugin validates and defaults to is the reference's
    ``QuadraticModel.max_draft_tokens`` (one trained branch)."""
    from diffspec.assets import SYNTH_TIDAR_DIR
    from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.plugin.sglang.config import _validate_quadratic_drafts, quadratic_max_drafts

    info = inspect_checkpoint(SYNTH_TIDAR_DIR)
    assert quadratic_max_drafts(info) == load_quadratic(SYNTH_TIDAR_DIR).max_draft_tokens == 8
    _validate_quadratic_drafts(info, 8)
    with pytest.raises(CheckpointError, match=r"at most 8 tokens per step; 9 requested"):
        _validate_quadratic_drafts(info, 9)
    with pytest.raises(CheckpointError):
        _validate_quadratic_drafts(info, 0)


def test_kv_window_per_step() -> None:
    """The KV slots a step writes past the committed length: the verify tokens on the
    torch-native path, the whole step (verify + branches) for the GPU kernels."""
    from diffspec.assets import SYNTH_TIDAR_DIR
    from diffspec.plugin.sglang.config import tidar_kv_window

    assert tidar_kv_window(9, SYNTH_TIDAR_DIR, torch_native=True) == 9
    assert tidar_kv_window(9, SYNTH_TIDAR_DIR, torch_native=False) == 81 == tokens_per_step(8, True)
    assert tidar_kv_window(5, SYNTH_TIDAR_DIR, torch_native=False) == 25


def test_steps_fit_sglangs_activation_budget() -> None:
    """A TIDAR forward never runs more tokens than SGLang's memory accounting is sized for
    (:func:`~diffspec.plugin.sglang.config.activation_tokens`, SGLang's
    ``memory_hook.py`` rule): the step pre-drafts the most it can within it, 0 (no
    branches) when even one draft would not fit."""
    from types import SimpleNamespace

    from diffspec.model_executors.sglang.quadratic import (
        decode_step_rows,
        fit_drafts,
        prefill_rows,
    )
    from diffspec.plugin.sglang.config import activation_tokens

    assert decode_step_rows(48, 8, 8, True) == 48 * 81 == 48 * tokens_per_step(8, True)
    assert decode_step_rows(48, 8, 0, True) == 48 * 9  # verify rows only
    assert decode_step_rows(4, 7, 7, False) == 4 * 72
    assert prefill_rows(300, 48, 8, True) == 300 + 48 * 8
    assert prefill_rows(300, 48, 0, True) == 300

    budget = 2048
    for bs, n in ((8, 8), (48, 8), (48, 3), (300, 8)):
        rows = lambda k: decode_step_rows(bs, n, k, True)  # noqa: E731
        k = fit_drafts(8, budget, rows)
        assert k == 0 or rows(k) <= budget
        assert k == 8 or rows(k + 1) > budget  # the most that fits
    assert fit_drafts(8, budget, lambda k: decode_step_rows(8, 8, k, True)) == 8  # 648 rows
    assert fit_drafts(8, budget, lambda k: decode_step_rows(48, 8, k, True)) == 3  # 48 x 36
    assert fit_drafts(8, budget, lambda k: decode_step_rows(48, 3, k, True)) == 8  # 48 x 36
    assert fit_drafts(8, budget, lambda k: decode_step_rows(300, 8, k, True)) == 0
    assert fit_drafts(8, budget, lambda k: prefill_rows(2000, 16, k, True)) == 3

    def args(**kw) -> SimpleNamespace:
        base = {"disaggregation_mode": "null", "chunked_prefill_size": 4096,
                "max_prefill_tokens": 16384, "max_running_requests": 48,
                "speculative_num_draft_tokens": 9}
        return SimpleNamespace(**{**base, **kw})

    assert activation_tokens(args()) == 4096
    assert activation_tokens(args(chunked_prefill_size=512)) == 2048  # SGLang's floor
    assert activation_tokens(args(chunked_prefill_size=-1)) == 16384  # no chunking
    assert activation_tokens(args(disaggregation_mode="decode", max_running_requests=512)) \
        == 512 * 9
