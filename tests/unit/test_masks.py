"""Masks against brute force: each rule rebuilt with plain loops from its English definition."""

from __future__ import annotations

import itertools

import pytest
import torch

from diffspec.core.masks import (
    block_causal_mask,
    block_diffusion_mask,
    block_diffusion_training_mask,
    orthrus_dual_pass_mask,
    quadratic_branch_indices,
    quadratic_mask,
    quadratic_num_tokens,
    to_additive_mask,
)


def _tensor(rows: list[list[bool]], cols: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), cols)


# ---------------------------------------------------------------- brute-force builders


def brute_causal(n: int) -> torch.Tensor:
    return _tensor([[j <= i for j in range(n)] for i in range(n)], n)


def brute_block_causal(n: int, block: int, prefix: int) -> torch.Tensor:
    def sees(i: int, j: int) -> bool:
        if i < prefix:  # causal prefix
            return j <= i
        if j < prefix:  # blocks see the whole prefix
            return True
        return (j - prefix) // block <= (i - prefix) // block

    return _tensor([[sees(i, j) for j in range(n)] for i in range(n)], n)


def brute_bd3lm(n: int, block: int) -> torch.Tensor:
    def sees(i: int, j: int) -> bool:
        qi_clean, kj_clean = i >= n, j >= n
        bi, bj = (i % n) // block, (j % n) // block
        if not qi_clean and not kj_clean:
            return bi == bj
        if not qi_clean and kj_clean:
            return bj < bi
        if qi_clean and kj_clean:
            return bj <= bi
        return False

    return _tensor([[sees(i, j) for j in range(2 * n)] for i in range(2 * n)], 2 * n)


def brute_orthrus(n: int, anchors: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = n + len(anchors) * k
    rows, pos = [], []
    for i in range(total):
        row = []
        for j in range(total):
            if i < n:  # clean query: causal over clean, never a block
                row.append(j < n and j <= i)
            else:
                b = (i - n) // k
                if j < n:  # strictly before its anchor
                    row.append(j < anchors[b])
                else:  # own block only
                    row.append((j - n) // k == b)
        rows.append(row)
        pos.append(i if i < n else anchors[(i - n) // k] + (i - n) % k)
    return _tensor(rows, total), torch.tensor(pos, dtype=torch.long)


def brute_quadratic(prefix: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our grouped layout: verify tokens t_0..t_n, then branches 0..n of k masks each."""
    tokens = [("verify", i, 0) for i in range(n + 1)]
    tokens += [("branch", a, o) for a in range(n + 1) for o in range(k)]
    rows, pos = [], []
    for kind, a, o in tokens:
        row = [True] * prefix  # everything sees the cached prefix
        for kind2, a2, _ in tokens:
            if kind2 == "verify":
                row.append(a2 <= a)  # t_0..t_a (causal for verify tokens, too)
            else:
                row.append(kind == "branch" and a2 == a)  # own branch only
        rows.append(row)
        pos.append(prefix + a if kind == "verify" else prefix + a + 1 + o)
    return _tensor(rows, prefix + len(tokens)), torch.tensor(pos, dtype=torch.long)


def brute_nld_interleaved(prefix: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NLD's quadratic rule, written from its mask functions: b sub-blocks [d_i, mask x b].

    Non-cached form (clean prefix as queries too): clean causal; a draft-region query sees
    every clean key; a query sees the first token of sub-block j iff that key is not after
    it; a non-first token of sub-block i sees all of sub-block i. Position ids
    clean_len+i .. clean_len+i+b for sub-block i.
    """
    total = prefix + b * (b + 1)
    rows, pos = [], []
    for q in range(total):
        row = []
        for kv in range(total):
            if q < prefix:
                row.append(kv <= q)
                continue
            rq, rk = q - prefix, kv - prefix
            if kv < prefix or rk % (b + 1) == 0 and kv <= q:
                row.append(True)
            else:
                row.append(rq // (b + 1) == rk // (b + 1) and rq % (b + 1) != 0)
        rows.append(row)
        pos.append(q if q < prefix else prefix + (q - prefix) // (b + 1) + (q - prefix) % (b + 1))
    return _tensor(rows, total), torch.tensor(pos, dtype=torch.long)


# ---------------------------------------------------------------- tests


def test_to_additive_mask_zero_and_neg_inf() -> None:
    mask = brute_causal(3)
    bias = to_additive_mask(mask, torch.float16)
    assert bias.dtype == torch.float16
    assert torch.equal(bias == 0, mask)
    assert torch.isneginf(bias[~mask]).all()


def test_to_additive_mask_rejects_non_bool() -> None:
    with pytest.raises(TypeError):
        to_additive_mask(torch.ones(2, 2))


def test_to_additive_mask_matches_bool_sdpa() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    mask = block_causal_mask(5, 2, prefix_len=1)
    by_bool = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    by_bias = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=to_additive_mask(mask)
    )
    torch.testing.assert_close(by_bool, by_bias)


@pytest.mark.parametrize("prefix,block", [(0, 1), (0, 4), (5, 1), (5, 3), (3, 32)])
def test_block_diffusion_mask_is_all_visible(prefix: int, block: int) -> None:
    mask = block_diffusion_mask(prefix, block)
    assert mask.shape == (block, prefix + block)
    assert mask.all()


@pytest.mark.parametrize(
    "n,block,prefix", list(itertools.product([0, 1, 5, 9], [1, 2, 4], [0, 1, 3]))
)
def test_block_causal_mask_matches_brute_force(n: int, block: int, prefix: int) -> None:
    assert torch.equal(block_causal_mask(n, block, prefix), brute_block_causal(n, block, prefix))


def test_block_causal_mask_block_size_1_is_causal() -> None:
    assert torch.equal(block_causal_mask(6, 1), brute_causal(6))
    assert torch.equal(block_causal_mask(6, 1, prefix_len=4), brute_causal(6))


def test_block_causal_mask_prefix_covering_everything_is_causal() -> None:
    assert torch.equal(block_causal_mask(5, 3, prefix_len=5), brute_causal(5))
    assert torch.equal(block_causal_mask(5, 3, prefix_len=9), brute_causal(5))


def test_block_causal_mask_fast_dllm_v2_example() -> None:
    # Fast-dLLM v2 eval mask: block_q >= block_kv with blocks aligned at 0.
    expected = torch.tensor([[j // 2 <= i // 2 for j in range(5)] for i in range(5)])
    assert torch.equal(block_causal_mask(5, 2), expected)


@pytest.mark.parametrize("n,block", [(0, 1), (1, 1), (4, 2), (5, 2), (6, 3), (3, 8)])
def test_block_diffusion_training_mask_matches_brute_force(n: int, block: int) -> None:
    mask, positions = block_diffusion_training_mask(n, block)
    assert torch.equal(mask, brute_bd3lm(n, block))
    assert torch.equal(positions, torch.arange(n).repeat(2))
    # The clean half is the block-causal mask.
    assert torch.equal(mask[n:, n:], block_causal_mask(n, block))


ORTHRUS_CASES = [
    (6, [2], 3),
    (6, [0], 3),  # anchor at 0: sees no clean token
    (6, [5], 3),  # anchor at L-1: positions run past the sequence
    (6, [0, 5], 1),  # block size 1
    (8, [1, 3, 4], 4),
    (8, [3, 3], 2),  # repeated anchor (official padding of spare slots)
    (5, [], 3),  # no anchors: plain causal
    (1, [0], 2),
]


@pytest.mark.parametrize("n,anchors,k", ORTHRUS_CASES)
def test_orthrus_dual_pass_mask_matches_brute_force(n: int, anchors: list[int], k: int) -> None:
    mask, positions = orthrus_dual_pass_mask(n, anchors, k)
    want_mask, want_pos = brute_orthrus(n, anchors, k)
    assert torch.equal(mask, want_mask)
    assert torch.equal(positions, want_pos)


def test_orthrus_dual_pass_mask_batched_rows_are_independent() -> None:
    anchors = torch.tensor([[1, 4], [0, 5]])
    mask, positions = orthrus_dual_pass_mask(6, anchors, 3)
    assert mask.shape == (2, 12, 12) and positions.shape == (2, 12)
    for row in range(2):
        want_mask, want_pos = brute_orthrus(6, anchors[row].tolist(), 3)
        assert torch.equal(mask[row], want_mask)
        assert torch.equal(positions[row], want_pos)


def test_orthrus_dual_pass_mask_anchor_not_visible_to_its_block() -> None:
    mask, _ = orthrus_dual_pass_mask(6, [3], 2)
    assert mask[6:, :3].all()
    assert not mask[6:, 3:6].any()  # the clean anchor and everything after it


def test_orthrus_dual_pass_mask_rejects_out_of_range_anchor() -> None:
    with pytest.raises(ValueError):
        orthrus_dual_pass_mask(4, [4], 2)
    with pytest.raises(ValueError):
        orthrus_dual_pass_mask(4, [-1], 2)


QUADRATIC_CASES = list(itertools.product([0, 1, 4], [0, 1, 3], [1, 2, 4]))


@pytest.mark.parametrize("prefix,n,k", QUADRATIC_CASES)
def test_quadratic_mask_matches_brute_force(prefix: int, n: int, k: int) -> None:
    mask, positions = quadratic_mask(prefix, n, k)
    want_mask, want_pos = brute_quadratic(prefix, n, k)
    total = quadratic_num_tokens(n, k)
    assert mask.shape == (total, prefix + total)
    assert torch.equal(mask, want_mask)
    assert torch.equal(positions, want_pos)


@pytest.mark.parametrize("prefix,b", [(0, 1), (0, 2), (3, 2), (2, 4)])
def test_quadratic_mask_is_a_permutation_of_nld_layout(prefix: int, b: int) -> None:
    # NLD: b sub-blocks [d_i, mask x b]; ours: n = b-1 drafts (t_0 is the anchor), k = b.
    nld_mask, nld_pos = brute_nld_interleaved(prefix, b)
    mask, positions = quadratic_mask(prefix, b - 1, b)
    # Our index of NLD's token (sub-block i, offset o): o == 0 -> verify t_i, else branch i.
    order = [i if o == 0 else b + i * b + (o - 1) for i in range(b) for o in range(b + 1)]
    ours_in_nld_order = torch.tensor(order)
    key_order = torch.cat([torch.arange(prefix), prefix + ours_in_nld_order])
    nld_new_rows = nld_mask[prefix:]  # drop the clean query rows (they are the cache)
    assert torch.equal(mask[ours_in_nld_order][:, key_order], nld_new_rows)
    assert torch.equal(positions[ours_in_nld_order], nld_pos[prefix:])


def test_quadratic_mask_zero_drafts_is_linear_draft() -> None:
    # Anchor + one branch: the anchor is causal, the masks see the anchor and each other.
    mask, positions = quadratic_mask(3, 0, 4)
    assert torch.equal(positions, torch.tensor([3, 4, 5, 6, 7]))
    assert torch.equal(mask[0], torch.tensor([True] * 4 + [False] * 4))
    assert mask[1:].all()


def test_quadratic_verify_rows_are_causal() -> None:
    prefix, n, k = 2, 3, 2
    mask, positions = quadratic_mask(prefix, n, k)
    verify = mask[: n + 1, : prefix + n + 1]
    assert torch.equal(verify[:, prefix:], brute_causal(n + 1))
    assert not mask[: n + 1, prefix + n + 1 :].any()  # verify tokens never see branches
    assert torch.equal(positions[: n + 1], prefix + torch.arange(n + 1))


@pytest.mark.parametrize("n,k", [(0, 1), (0, 3), (2, 1), (3, 4)])
def test_quadratic_branch_indices_select_each_branch(n: int, k: int) -> None:
    prefix = 5
    mask, positions = quadratic_mask(prefix, n, k)
    for accepted in range(n + 1):
        idx = quadratic_branch_indices(accepted, n, k)
        assert idx.shape == (k,)
        # The branch starts right after verify token t_accepted.
        assert torch.equal(positions[idx], prefix + accepted + 1 + torch.arange(k))
        # And sees exactly t_0..t_accepted among the verify tokens.
        seen = mask[idx][:, prefix : prefix + n + 1]
        assert torch.equal(seen, (torch.arange(n + 1) <= accepted).expand(k, -1))


def test_quadratic_branch_indices_batched_and_validated() -> None:
    idx = quadratic_branch_indices(torch.tensor([0, 2]), 2, 3)
    assert torch.equal(idx, torch.tensor([[3, 4, 5], [9, 10, 11]]))
    with pytest.raises(ValueError):
        quadratic_branch_indices(3, 2, 3)
    with pytest.raises(ValueError):
        quadratic_branch_indices(-1, 2, 3)


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError):
        block_causal_mask(4, 0)
    with pytest.raises(ValueError):
        quadratic_mask(0, -1, 2)
    with pytest.raises(ValueError):
        quadratic_mask(0, 1, 0)
