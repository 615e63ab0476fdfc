"""Engine tier: the parts of ReFusion on vLLM that run on vLLM's own classes without an engine
process (vLLM must be installed, hence this tier; the engine runs,
``tests/engine/test_vllm_refusion.py``, check the decoding against the reference): the
logits its decoders read, issue 29 row 8. The logits of a ReFusion forward's rows (up to
the step's token budget x vocabulary, outside vLLM's memory accounting) are never
materialised whole: :func:`~diffspec.spec_workers.vllm.refusion.logit_rows` computes what
the decoders read (argmax, plan score, the next token's probability) a bounded number of
rows at a time, and only for the rows they read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from tests.engine.common import largest_new_vocab_tensor
from tests.engine.conftest import require_engine

require_engine("vllm")  # the whole module: skipped, or failed where CI requires vLLM

from diffspec.spec_workers.vllm.refusion import (
    ReFusionModelState,
    ReFusionSampler,
    _Request,
    _Seq,
    logit_rows,
)

VOCAB, HIDDEN, CHUNK = 97, 16, 8


class _Head:
    """An LM head (``compute_logits``) that records the rows of every call."""

    def __init__(self) -> None:
        self.weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
        self.rows: list[int] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, HIDDEN] -> [R, VOCAB]
        self.rows.append(hidden.shape[0])
        return hidden @ self.weight.T


def _whole(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What :func:`logit_rows` computes, from all the rows' logits at once."""
    probs = torch.softmax(logits.float(), dim=-1)
    return (logits.argmax(-1), probs.max(-1).values,
            probs.gather(-1, targets[:, None])[:, 0])


def _assert_stats(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7)


def test_logit_rows_equal_whole_logits_in_bounded_chunks() -> None:
    """300 rows asked, in any order: the whole computation's argmax, top probability and
    target probability, from at most CHUNK rows of logits at a time."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(400, HIDDEN, generator=g)
    index = torch.randperm(400, generator=g)[:300]
    targets = torch.randint(VOCAB, (300,), generator=g)
    head = _Head()
    out: dict = {}
    size = largest_new_vocab_tensor(
        lambda: out.setdefault("o", logit_rows(head, hidden, index, targets, CHUNK)), VOCAB)
    _assert_stats(out["o"], _whole(hidden[index] @ head.weight.T, targets))
    assert max(head.rows) == CHUNK and sum(head.rows) == 300
    assert 0 < size <= CHUNK * VOCAB * 4, size  # whole: 300 x VOCAB x 4 bytes
    argmax, top, target = logit_rows(head, hidden, index[:0], targets[:0], CHUNK)
    assert argmax.dtype == torch.int64 and argmax.numel() == top.numel() == target.numel() == 0


def _state() -> ReFusionModelState:
    """A ReFusion model state built without vLLM's runner: its forward's hidden states are
    given (``_hidden``), its LM head is :class:`_Head`."""
    state = object.__new__(ReFusionModelState)
    state.model = SimpleNamespace(compute_logits=_Head())
    state.logits_rows = CHUNK
    state.slot_size, state.num_blocks, state.mask_token_id = 4, 2, 5
    return state


def test_forward_reads_its_rows_logits_in_bounded_chunks() -> None:
    """One forward of 120 rows (a plan, a verify, parallel-completion rows read from
    ``start`` on, a re-encoding read nowhere): each sequence's stats are those of the whole
    forward's logits for the rows it reads (the next token: its next input), computed
    CHUNK rows at a time and for those rows only; whole, the forward's logits would be 15
    chunks."""
    g = torch.Generator().manual_seed(2)
    seqs = [_Seq(0, torch.randint(VOCAB, (n,), generator=g), torch.arange(n), 0,
                 logits_from=start) for n, start in ((32, 0), (16, 0), (8, 3), (8, 3),
                                                     (40, 40), (16, 0))]
    total = sum(len(s.input_ids) for s in seqs)
    hidden = torch.randn(total, HIDDEN, generator=g)
    state = _state()
    state._hidden = lambda _: hidden
    out: dict = {}
    size = largest_new_vocab_tensor(lambda: out.setdefault("o", state.forward(seqs)), VOCAB)
    head = state.model.compute_logits
    read = sum(len(s.input_ids) - s.logits_from for s in seqs)
    assert max(head.rows) == CHUNK and sum(head.rows) == read < total
    logits = hidden @ head.weight.T
    first = 0
    for seq, stats in zip(seqs, out["o"]):
        rows = slice(first + seq.logits_from, first + len(seq.input_ids))
        want = _whole(logits[rows], seq.input_ids.roll(-1)[seq.logits_from:])
        _assert_stats((stats.argmax, stats.top_prob, stats.next_prob), want)
        first += len(seq.input_ids)
    assert total == 15 * CHUNK
    assert 0 < size <= CHUNK * VOCAB * 4, size


def test_first_plans_read_the_canvas_logits_in_bounded_chunks() -> None:
    """The canvas step's logits (vLLM's, ``[rows, vocab]``): each decoding request's first
    plan reads the rows of its first serial block only (max_tokens 30: 8 slots of 4 in 2
    blocks, 16 rows; 16: 2 slots per block, 8 rows), CHUNK rows at a time."""
    g = torch.Generator().manual_seed(4)
    canvas = 32
    logits = torch.randn(3 * canvas, VOCAB, generator=g)
    cu = np.arange(4) * canvas
    decoding = [(0, _Request(30, ())), (2, _Request(16, ())), (1, _Request(30, ()))]
    sampler = object.__new__(ReFusionSampler)
    sampler.state = _state()
    out: dict = {}
    size = largest_new_vocab_tensor(
        lambda: out.setdefault("o", sampler._first_plans(logits, decoding, cu)), VOCAB)
    for (i, _), rows, stats in zip(decoding, (16, 8, 16), out["o"]):
        part = logits[i * canvas: i * canvas + rows]
        want = _whole(part, torch.full((rows,), 5))
        _assert_stats((stats.argmax, stats.top_prob, stats.next_prob), want)
    assert 0 < size <= CHUNK * VOCAB * 4, size
