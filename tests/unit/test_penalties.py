"""Per-row penalties on verify logits (:mod:`diffspec.core.penalties`): row ``j`` equals
what an AR step would compute with the output so far plus the drafts before the row, in
SGLang's penaltylib arithmetic (a direct one-row re-implementation here)."""

from __future__ import annotations

import pytest
import torch

from diffspec.core.penalties import RequestPenalties, apply_penalties_per_row


def _ar_row(logits: torch.Tensor, history: list[int], p: RequestPenalties) -> torch.Tensor:
    """One AR step's transforms, as SGLang's penalizers apply them to one request."""
    vocab = logits.numel()
    acc = torch.zeros(vocab)
    freq = torch.zeros(vocab)
    for t in history:  # one cumulate_output_tokens call per emitted token
        freq[t] += p.frequency
    acc -= freq
    pres = torch.zeros(vocab)
    pres[list(set(history))] = p.presence
    acc -= pres
    if len(history) < p.min_new_tokens:
        acc[list(p.stop_token_ids)] += float("-inf")
    out = logits + acc
    scale = torch.ones(vocab)
    scale[list(set(history))] = p.repetition
    out = torch.where(out < 0, out * scale, out / scale)
    if p.logit_bias:
        for t, v in p.logit_bias.items():
            out[t] += v
    return out


CASES = [
    RequestPenalties(repetition=1.3),
    RequestPenalties(frequency=0.7),
    RequestPenalties(presence=0.9),
    RequestPenalties(min_new_tokens=7, stop_token_ids=frozenset({3, 5})),
    RequestPenalties(logit_bias={2: 5.0, 9: -100.0}),
    RequestPenalties(repetition=1.5, frequency=0.25, presence=0.5, min_new_tokens=6,
                     stop_token_ids=frozenset({1}), logit_bias={4: 1.5}),
    RequestPenalties(),
]


def test_each_row_is_the_ar_step_with_the_drafts_before_it() -> None:
    gen = torch.Generator().manual_seed(0)
    bs, width, vocab = len(CASES), 6, 12
    logits = torch.randn(bs, width, vocab, generator=gen) * 3
    drafts = torch.randint(0, vocab, (bs, width - 1), generator=gen)
    drafts[:, 1] = drafts[:, 0]  # a repeated draft: counts go to 2 inside the block
    histories = [torch.randint(0, vocab, (n,), generator=gen).tolist()
                 for n in (4, 1, 3, 2, 5, 3, 0)]
    out = apply_penalties_per_row(logits.clone(), drafts, histories, CASES)
    for b, p in enumerate(CASES):
        for j in range(width):
            want = _ar_row(logits[b, j], histories[b] + drafts[b, :j].tolist(), p)
            torch.testing.assert_close(out[b, j], want, rtol=0, atol=0, equal_nan=True)


def test_neutral_requests_are_bit_identical() -> None:
    logits = torch.randn(2, 4, 8)
    drafts = torch.randint(0, 8, (2, 3))
    out = apply_penalties_per_row(logits.clone(), drafts, [[1, 2], [3]],
                                  [RequestPenalties(repetition=2.0), RequestPenalties()])
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])
    same = apply_penalties_per_row(logits.clone(), drafts, [[1], [2]],
                                   [RequestPenalties(), RequestPenalties()])
    assert torch.equal(same, logits)


def test_min_new_tokens_lifts_inside_the_block() -> None:
    """Stop tokens are banned on the rows whose history is shorter than min_new_tokens."""
    logits = torch.zeros(1, 5, 6)
    out = apply_penalties_per_row(logits, torch.zeros(1, 4, dtype=torch.int64), [[0, 0]],
                                  [RequestPenalties(min_new_tokens=4,
                                                    stop_token_ids=frozenset({5}))])
    assert out[0, :, 5].tolist() == [float("-inf")] * 2 + [0.0] * 3


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="histories"):
        apply_penalties_per_row(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.int64),
                                [[1]], [RequestPenalties()] * 2)
    with pytest.raises(ValueError, match="drafts"):
        apply_penalties_per_row(torch.zeros(1, 3, 4), torch.zeros(1, 1, dtype=torch.int64),
                                [[1]], [RequestPenalties()])
