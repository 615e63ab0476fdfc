"""ReFusion slot rules (layout, plan, verify, reorder) on hand-built probabilities."""

from __future__ import annotations

import pytest
import torch

from diffspec.core.slots import (
    committed_slot_lengths,
    first_stop_in_slots,
    longest_layout,
    reorder_for_kv_reuse,
    score_slots,
    select_slots,
    slot_layout,
    verify_slot_drafts,
)

VOCAB = 6


def first_logits(probs: list[tuple[int, float]]) -> torch.Tensor:
    """[num_slots, VOCAB] logits putting probability p on token t, the rest spread evenly."""
    out = torch.empty(len(probs), VOCAB)
    for s, (token, p) in enumerate(probs):
        row = torch.full((VOCAB,), (1.0 - p) / (VOCAB - 1))
        row[token] = p
        out[s] = row.log()
    return out


@pytest.mark.parametrize(("max_tokens", "slot", "blocks", "expected"), [
    (70, 8, 1, (72, 72)),  # rounded up to whole slots
    (64, 8, 2, (64, 32)),
    (72, 8, 2, (72, None)),  # blocks of 36: not whole slots of 8
    (60, 8, 3, (64, None)),  # 64 tokens do not split into 3 blocks
])
def test_slot_layout(max_tokens: int, slot: int, blocks: int, expected: tuple) -> None:
    assert slot_layout(max_tokens, slot, blocks) == expected


@pytest.mark.parametrize(("width", "slot", "blocks", "expected"), [
    (64, 8, 2, 64), (72, 8, 2, 64), (256, 32, 4, 256), (40, 8, 3, 24), (24, 8, 4, 0)])
def test_longest_layout_is_the_longest_that_splits(width: int, slot: int, blocks: int,
                                                   expected: int) -> None:
    """A request's default max_tokens: the longest within ``width`` that slot_layout splits,
    and no longer one does."""
    got = longest_layout(width, slot, blocks)
    assert got == expected
    if got:
        assert slot_layout(got, slot, blocks)[1] is not None
    assert all(slot_layout(n, slot, blocks)[1] is None or slot_layout(n, slot, blocks)[0] > width
               for n in range(got + 1, width + 1))


# ---------------------------------------------------------------- plan: score and select


def test_score_is_max_probability_at_first_position() -> None:
    scores, tokens = score_slots(first_logits([(2, 0.9), (4, 0.5), (1, 0.3)]))
    torch.testing.assert_close(scores, torch.tensor([0.9, 0.5, 0.3]))
    assert tokens.tolist() == [2, 4, 1]


def test_score_decoded_slots_are_neg_inf() -> None:
    scores, _ = score_slots(
        first_logits([(2, 0.9), (4, 0.5)]), is_masked=torch.tensor([False, True])
    )
    assert torch.isneginf(scores[0]) and scores[1] > 0


def test_score_batched() -> None:
    logits = torch.stack([first_logits([(1, 0.8), (2, 0.4)]), first_logits([(3, 0.6), (0, 0.95)])])
    scores, tokens = score_slots(logits)
    assert scores.shape == (2, 2)
    assert tokens.tolist() == [[1, 2], [3, 0]]


def test_select_all_over_threshold() -> None:
    scores = torch.tensor([0.95, 0.2, 0.91, 0.5])
    assert select_slots(scores, 0.9).tolist() == [True, False, True, False]


def test_select_all_when_threshold_is_low() -> None:
    scores = torch.tensor([0.95, 0.2, 0.91, 0.5])
    assert select_slots(scores, 0.0).all()


def test_select_none_passes_falls_back_to_top1() -> None:
    scores = torch.tensor([0.3, 0.7, 0.5])
    assert select_slots(scores, 0.9).tolist() == [False, True, False]


def test_select_threshold_one_forces_top1() -> None:
    scores = torch.tensor([0.99, 1.0, 0.5])
    assert select_slots(scores, 1.0).tolist() == [False, True, False]


def test_select_equal_to_threshold_does_not_pass() -> None:
    scores = torch.tensor([0.9, 0.8])
    assert select_slots(scores, 0.9).tolist() == [True, False]  # only via the top-1 fallback
    assert select_slots(torch.tensor([0.9, 0.95]), 0.9).tolist() == [False, True]


def test_select_top1_tie_goes_to_lower_index() -> None:
    assert select_slots(torch.tensor([0.4, 0.6, 0.6]), 0.9).tolist() == [False, True, False]


def test_select_skips_decoded_slots() -> None:
    scores = torch.tensor([float("-inf"), 0.2, float("-inf")])
    assert select_slots(scores, 0.9).tolist() == [False, True, False]
    assert not select_slots(torch.full((3,), float("-inf")), 0.9).any()


def test_select_batched_rows_independent() -> None:
    scores = torch.tensor([[0.95, 0.2], [0.3, 0.4], [float("-inf"), float("-inf")]])
    assert select_slots(scores, 0.9).tolist() == [[True, False], [False, True], [False, False]]


# ---------------------------------------------------------------- infill: verify drafts
# Rules of ML-GSAI/ReFusion generate.py: the first open token is always kept, then the
# longest run with prob strictly over the threshold.


def test_verify_keeps_first_token_then_longest_run_over_threshold() -> None:
    drafts = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    probs = torch.tensor(
        [
            [0.9, 0.8, 0.7, 0.6],  # all pass
            [0.9, 0.3, 0.9, 0.9],  # stops at the first failure, later passes do not count
            [0.1, 0.9, 0.9, 0.9],  # first token is the plan's choice: kept whatever its prob
            [0.9, 0.1, 0.1, 0.1],  # only the first token
        ]
    )
    assert verify_slot_drafts(drafts, probs, 0.4).tolist() == [4, 1, 4, 1]


def test_verify_threshold_is_strict() -> None:
    drafts = torch.tensor([[1, 2, 3]])
    probs = torch.tensor([[0.0, 0.41, 0.4]])
    assert verify_slot_drafts(drafts, probs, 0.4).tolist() == [2]


def test_verify_continues_after_accepted_prefix() -> None:
    drafts = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    probs = torch.tensor([[0.0, 0.0, 0.0, 0.9, 0.1]] * 3)  # ignored at positions <= accepted
    accepted = torch.tensor([2, 1, 5])
    # row 0: keeps 2, forced 3rd token, 4th passes (0.9), 5th fails -> 4
    # row 1: keeps 1, forced 2nd, 3rd fails -> 2;  row 2: already complete -> 5
    assert verify_slot_drafts(drafts, probs, 0.5, accepted).tolist() == [4, 2, 5]


def test_verify_stops_at_placeholder() -> None:
    drafts = torch.tensor([[1, 2, -1, -1], [-1, -1, -1, -1]])
    probs = torch.ones(2, 4)
    assert verify_slot_drafts(drafts, probs, 0.4).tolist() == [2, 0]


def test_verify_threshold_zero_accepts_everything_and_one_only_the_forced_token() -> None:
    drafts = torch.tensor([[1, 2, 3]])
    probs = torch.tensor([[0.2, 0.01, 0.5]])
    assert verify_slot_drafts(drafts, probs, 0.0).tolist() == [3]
    assert verify_slot_drafts(drafts, torch.ones(1, 3), 1.0).tolist() == [1]
    assert verify_slot_drafts(drafts, torch.ones(1, 3), 1.0, torch.tensor([1])).tolist() == [2]


def test_verify_empty_and_shape_mismatch() -> None:
    empty = verify_slot_drafts(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4), 0.5)
    assert empty.shape == (0,)
    with pytest.raises(ValueError):
        verify_slot_drafts(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), 0.5)


# ---------------------------------------------------------------- stop tokens in slots


def test_first_stop_only_among_accepted_tokens() -> None:
    tokens = torch.tensor([[4, 9, 5, 9], [9, 4, 4, 4], [4, 4, 4, 9], [4, 4, 4, 4]])
    accepted = torch.tensor([4, 4, 3, 4])
    # row 2's stop is not accepted yet; row 3 has none
    assert first_stop_in_slots(tokens, accepted, [9]).tolist() == [1, 0, -1, -1]


def test_first_stop_any_of_several_ids_and_none_given() -> None:
    tokens = torch.tensor([[4, 7, 9, 4]])
    assert first_stop_in_slots(tokens, torch.tensor([4]), [9, 7]).tolist() == [1]
    assert first_stop_in_slots(tokens, torch.tensor([4]), []).tolist() == [-1]


# ---------------------------------------------------------------- reorder for KV reuse


def test_reorder_decoded_slots_first_in_decode_order() -> None:
    # 4 slots of 2 tokens; slot 2 decoded in round 0, slot 0 in round 1; 1 and 3 masked.
    order = reorder_for_kv_reuse([1, -1, 0, -1], 2)
    assert order.perm.tolist() == [4, 5, 0, 1, 2, 3, 6, 7]
    assert order.position_ids.tolist() == [4, 5, 0, 1, 2, 3, 6, 7]


def test_reorder_round_trip_restores_original_order() -> None:
    tokens = torch.arange(100, 110)
    order = reorder_for_kv_reuse([-1, 2, 0, -1, 2], [1, 3, 2, 2, 2], start_position=7)
    reordered = tokens[order.perm]
    assert torch.equal(reordered[order.inverse], tokens)
    assert torch.equal(order.perm[order.inverse], torch.arange(10))
    assert torch.equal(order.inverse[order.perm], torch.arange(10))


def test_reorder_keeps_true_position_ids() -> None:
    positions = torch.arange(10) + 7
    order = reorder_for_kv_reuse([-1, 2, 0, -1, 2], [1, 3, 2, 2, 2], start_position=7)
    assert torch.equal(order.position_ids, positions[order.perm])
    # Slot 2 (round 0) first, then slots 1 and 4 (round 2, original order), then 0 and 3.
    assert order.position_ids.tolist() == [11, 12, 8, 9, 10, 15, 16, 7, 13, 14]


def test_reorder_tokens_never_move_inside_a_slot() -> None:
    order = reorder_for_kv_reuse([3, -1, 1], 4)
    chunks = order.perm.view(3, 4)
    assert ((chunks[:, 1:] - chunks[:, :-1]) == 1).all()


def test_reorder_all_masked_or_all_decoded_in_order_is_identity() -> None:
    assert reorder_for_kv_reuse([-1, -1, -1], 2).perm.tolist() == list(range(6))
    assert reorder_for_kv_reuse([0, 1, 2], 2).perm.tolist() == list(range(6))


def test_reorder_empty_and_invalid() -> None:
    order = reorder_for_kv_reuse([], 4)
    assert order.perm.numel() == 0 and order.inverse.numel() == 0
    with pytest.raises(ValueError):
        reorder_for_kv_reuse([0, 1], [2])
    with pytest.raises(ValueError):
        reorder_for_kv_reuse([0, 1], [2, 0])


@pytest.mark.parametrize(("accepted", "stop_at", "expected"), [
    ([4, 4, 2], [-1, -1, -1], ([4, 4], False)),  # two whole slots, the third partial
    ([2, 4], [-1, -1], ([], False)),  # the first slot partial: nothing committed
    ([4, 3, 4], [-1, 1, -1], ([4, 2], True)),  # a stop inside slot 1 ends the commit
    ([4, 4], [2, -1], ([3], True)),  # a stop in a whole slot: up to and including it
    ([4, 4], [-1, -1], ([4, 4], False)),
])
def test_committed_slot_lengths(accepted, stop_at, expected) -> None:
    got = committed_slot_lengths(torch.tensor(accepted), torch.tensor(stop_at), 4)
    assert got == expected

