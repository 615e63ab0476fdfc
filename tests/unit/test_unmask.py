"""Confidence-threshold unmasking (Fast-dLLM) on hand-built logits."""

from __future__ import annotations

import pytest
import torch

from diffspec.core.unmask import confidence_unmask, shift_logits

MASK = 99
VOCAB = 8


def logits_for(rows: list[list[tuple[int, float]]]) -> torch.Tensor:
    """[batch, block, VOCAB] logits whose softmax puts probability p on token t at each position.

    The remaining 1 - p is spread evenly over the other VOCAB - 1 tokens (p > 1/VOCAB).
    """
    out = torch.empty(len(rows), len(rows[0]), VOCAB)
    for b, row in enumerate(rows):
        for j, (token, p) in enumerate(row):
            rest = (1.0 - p) / (VOCAB - 1)
            probs = torch.full((VOCAB,), rest)
            probs[token] = p
            out[b, j] = probs.log()
    return out


def canvas_of(rows: list[list[int | None]]) -> torch.Tensor:
    return torch.tensor([[MASK if t is None else t for t in row] for row in rows])


def test_selects_every_masked_position_over_threshold() -> None:
    logits = logits_for([[(1, 0.95), (2, 0.5), (3, 0.92), (4, 0.3)]])
    canvas = canvas_of([[None, None, None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.9)
    assert unmasked.tolist() == [[True, False, True, False]]
    assert new.tolist() == [[1, MASK, 3, MASK]]


def test_min_one_when_nothing_passes() -> None:
    logits = logits_for([[(1, 0.4), (2, 0.6), (3, 0.5)]])
    canvas = canvas_of([[None, None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.9)
    assert unmasked.tolist() == [[False, True, False]]
    assert new.tolist() == [[MASK, 2, MASK]]


def test_min_tokens_two_takes_the_two_most_confident() -> None:
    logits = logits_for([[(1, 0.4), (2, 0.6), (3, 0.5), (4, 0.2)]])
    canvas = canvas_of([[None, None, None, None]])
    _, unmasked = confidence_unmask(logits, canvas, MASK, 0.9, min_tokens=2)
    assert unmasked.tolist() == [[False, True, True, False]]


def test_min_tokens_zero_is_pure_threshold() -> None:
    logits = logits_for([[(1, 0.4), (2, 0.6)]])
    canvas = canvas_of([[None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.9, min_tokens=0)
    assert not unmasked.any()
    assert torch.equal(new, canvas)


def test_min_tokens_larger_than_masked_count_takes_all_masked() -> None:
    logits = logits_for([[(1, 0.4), (2, 0.6), (3, 0.5)]])
    canvas = canvas_of([[5, None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.99, min_tokens=10)
    assert unmasked.tolist() == [[False, True, True]]
    assert new.tolist() == [[5, 2, 3]]


def test_unmasked_positions_never_change() -> None:
    # Position 0 is already decoded (token 6) and its logits would pass the threshold.
    logits = logits_for([[(1, 0.99), (2, 0.95), (3, 0.2)]])
    canvas = canvas_of([[6, None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.9)
    assert new.tolist() == [[6, 2, MASK]]
    assert unmasked.tolist() == [[False, True, False]]


def test_all_unmasked_row_is_unchanged() -> None:
    logits = logits_for([[(1, 0.99), (2, 0.99)], [(3, 0.2), (4, 0.95)]])
    canvas = canvas_of([[5, 6], [None, None]])
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.9)
    assert new[0].tolist() == [5, 6]
    assert not unmasked[0].any()
    assert new[1].tolist() == [MASK, 4]


def test_threshold_one_unmasks_exactly_one_per_step() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 6, VOCAB) * 4
    logits[0, 2, 5] = 1e4  # softmax rounds to exactly 1.0: strict > still keeps one per step
    logits[0, 4, 1] = 1e4
    canvas = torch.full((3, 6), MASK)
    for step in range(6):
        masked_before = (canvas == MASK).sum(dim=-1)
        canvas, unmasked = confidence_unmask(logits, canvas, MASK, 1.0)
        assert unmasked.sum(dim=-1).tolist() == [1, 1, 1]
        assert ((canvas == MASK).sum(dim=-1) == masked_before - 1).all()
    assert not (canvas == MASK).any()
    _, unmasked = confidence_unmask(logits, canvas, MASK, 1.0)
    assert not unmasked.any()


def test_threshold_one_follows_confidence_order() -> None:
    logits = logits_for([[(1, 0.5), (2, 0.9), (3, 0.7)]])
    canvas = canvas_of([[None, None, None]])
    order = []
    for _ in range(3):
        canvas, unmasked = confidence_unmask(logits, canvas, MASK, 1.0)
        order.append(int(unmasked[0].nonzero()))
    assert order == [1, 2, 0]
    assert canvas.tolist() == [[1, 2, 3]]


def test_batch_rows_are_independent() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 5, VOCAB) * 3
    canvas = torch.full((4, 5), MASK)
    canvas[1, :2] = 7
    canvas[3] = torch.arange(5)
    new, unmasked = confidence_unmask(logits, canvas, MASK, 0.6)
    for row in range(4):
        one = slice(row, row + 1)
        row_new, row_unmasked = confidence_unmask(logits[one], canvas[one], MASK, 0.6)
        assert torch.equal(new[row], row_new[0])
        assert torch.equal(unmasked[row], row_unmasked[0])


def test_ties_go_to_the_lower_index() -> None:
    logits = logits_for([[(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.5)]])
    canvas = canvas_of([[None, None, None, None]])
    _, unmasked = confidence_unmask(logits, canvas, MASK, 0.9, min_tokens=2)
    assert unmasked.tolist() == [[True, True, False, False]]
    canvas = canvas_of([[0, None, None, None]])
    _, unmasked = confidence_unmask(logits, canvas, MASK, 0.9)
    assert unmasked.tolist() == [[False, True, False, False]]


def test_argmax_ties_pick_the_lowest_token_id() -> None:
    logits = torch.zeros(1, 1, VOCAB)
    logits[0, 0, 3] = logits[0, 0, 6] = 5.0
    new, _ = confidence_unmask(logits, canvas_of([[None]]), MASK, 0.9)
    assert new.tolist() == [[3]]


def test_equal_to_threshold_does_not_pass() -> None:
    logits = logits_for([[(1, 0.75), (2, 0.5)]])
    probs = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
    threshold = float(probs[0, 0])  # exactly the first position's confidence
    canvas = canvas_of([[None, None]])
    _, unmasked = confidence_unmask(logits, canvas, MASK, threshold, min_tokens=0)
    assert not unmasked.any()


def test_temperature_sampling_is_seeded_and_keeps_invariants() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 8, VOCAB)
    canvas = torch.full((2, 8), MASK)
    canvas[0, 0] = 4
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(123)
        runs.append(confidence_unmask(logits, canvas, MASK, 0.3, temperature=0.7, generator=gen))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    new, unmasked = runs[0]
    assert new[0, 0] == 4 and not unmasked[0, 0]
    assert (unmasked.sum(dim=-1) >= 1).all()
    assert ((new != MASK) == (unmasked | (canvas != MASK))).all()


def test_temperature_confidence_is_probability_of_the_sample() -> None:
    # One-hot-ish position: every sample is token 2 with p ~ 1, so it always passes 0.9.
    logits = torch.full((1, 2, VOCAB), -30.0)
    logits[0, 0, 2] = 30.0
    logits[0, 1] = 0.0  # uniform: p = 1/8 whatever is sampled
    gen = torch.Generator().manual_seed(0)
    new, unmasked = confidence_unmask(
        logits, canvas_of([[None, None]]), MASK, 0.9, temperature=1.0, generator=gen
    )
    assert unmasked.tolist() == [[True, False]]
    assert new[0, 0] == 2


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        confidence_unmask(torch.zeros(1, 3, VOCAB), torch.zeros(1, 2, dtype=torch.long), MASK, 0.9)
    with pytest.raises(ValueError):
        canvas = canvas_of([[None, None]])
        confidence_unmask(torch.zeros(1, 2, VOCAB), canvas, MASK, 0.9, min_tokens=-1)


def test_shift_logits_position_j_gets_logits_of_j_minus_1() -> None:
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    shifted = shift_logits(logits)
    assert torch.equal(shifted[:, 1:], logits[:, :-1])
    assert torch.equal(shifted[:, 0], logits[:, 0])
    assert torch.equal(shifted, torch.cat([logits[:, :1], logits[:, :-1]], dim=1))


def test_shift_logits_with_previous_logit() -> None:
    logits = torch.randn(2, 3, 5)
    prev = torch.randn(2, 1, 5)
    shifted = shift_logits(logits, prev)
    assert torch.equal(shifted[:, :1], prev)
    assert torch.equal(shifted[:, 1:], logits[:, :-1])
    assert torch.equal(shift_logits(logits[:, :1], prev), prev)  # block of one


def test_sub_block_start_is_the_sub_block_of_the_first_slot_with_work() -> None:
    from diffspec.core.unmask import sub_block_start

    work = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert sub_block_start(work, 4).tolist() == [0, 0, 4]
    assert sub_block_start(work, 2).tolist() == [2, 0, 4]


def test_unmask_block_keeps_each_row_in_its_sub_block_between_start_and_limit() -> None:
    """The engines' per-row step: a row decodes only masked slots in ``[start, limit)`` of
    its own current sub-block; prompt slots (before ``start``) and slots past ``limit`` stay
    masks, whatever their confidence; the mask token is never predicted."""
    from diffspec.core.unmask import unmask_block

    mask = VOCAB - 1
    logits = logits_for([[(1, 0.95), (2, 0.95), (3, 0.95), (4, 0.95)],
                         [(1, 0.95), (2, 0.95), (mask, 0.95), (5, 0.95)]])
    canvas = torch.tensor([[mask, mask, mask, mask], [3, 4, mask, mask]])
    new, committed = unmask_block(logits, canvas, torch.tensor([4, 3]), mask, 0.9,
                                  sub_block=2, start=torch.tensor([1, 0]))
    # row 0: work is slots 1..3, its sub-block is [0, 2): only slot 1 (slot 0 is prompt)
    # row 1: work is slot 2 (slot 3 is past the limit): its mask-token prediction is
    # replaced by the best real token
    assert committed.tolist() == [[False, True, False, False], [False, False, True, False]]
    assert new[0].tolist() == [mask, 2, mask, mask]
    assert new[1, :2].tolist() == [3, 4] and int(new[1, 2]) != mask
    assert int(new[1, 3]) == mask
