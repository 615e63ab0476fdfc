"""Accept rules: named cases with hand-built logits (run through every rule), validation,
seeded determinism, statistical losslessness tests (with negative controls that prove the
tests can fail), and coupled acceptance == coupled AR decoding token for token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from diffspec.core import PLACEHOLDER_TOKEN_ID
from diffspec.core.accept import (
    AcceptOutput,
    coupled_accept,
    greedy_accept,
    rejection_sample_accept,
    truncate_at_stop,
)
from diffspec.core.sampling import (
    coupled_sample,
    position_gumbel_noise,
    process_logits,
    sample_from_probs,
)

VOCAB = 10
EOS = 9
P_VALUE_MIN = 1e-3  # statistical tests use fixed seeds, so they are deterministic


# ------------------------------------------------------------------------------ helpers


def _pad(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], dtype=torch.int64)


def _batch(
    drafts: list[list[int]], target_argmax: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts padded with -1 -> [batch, n]; target logits [batch, n + 1, VOCAB] whose argmax at
    position j of request b is target_argmax[b][j] (positions past n_b + 1 get argmax 0)."""
    n = max((len(d) for d in drafts), default=0)
    for d, t in zip(drafts, target_argmax):
        assert len(t) == len(d) + 1, "one target argmax per draft token plus the bonus"
    argmax = _pad(target_argmax, n + 1, 0)
    logits = torch.randn(len(drafts), n + 1, VOCAB, generator=torch.Generator().manual_seed(0))
    logits.scatter_(2, argmax.unsqueeze(2), 10.0)
    return _pad(drafts, n, PLACEHOLDER_TOKEN_ID), logits


Tensor = torch.Tensor


def _greedy(drafts: Tensor, logits: Tensor, lens: Tensor | None) -> AcceptOutput:
    return greedy_accept(drafts, logits, lens)


def _coupled_zero_noise(drafts: Tensor, logits: Tensor, lens: Tensor | None) -> AcceptOutput:
    return coupled_accept(drafts, logits, torch.zeros_like(logits), lens)


def _rejection_point_mass(drafts: Tensor, logits: Tensor, lens: Tensor | None) -> AcceptOutput:
    # One-hot target probabilities make rejection sampling deterministic and equal to greedy.
    probs = torch.softmax(process_logits(logits, 0.0, -1, 1.0), -1)
    return rejection_sample_accept(drafts, None, probs, lens, torch.Generator().manual_seed(0))


def _rejection_one_hot_q(drafts: Tensor, logits: Tensor, lens: Tensor | None) -> AcceptOutput:
    probs = torch.softmax(process_logits(logits, 0.0, -1, 1.0), -1)
    q = torch.nn.functional.one_hot(drafts.clamp_min(0), VOCAB).float()
    return rejection_sample_accept(drafts, q, probs, lens, torch.Generator().manual_seed(0))


RULES = {
    "greedy": _greedy,
    "coupled_zero_noise": _coupled_zero_noise,
    "rejection_point_mass": _rejection_point_mass,
    "rejection_one_hot_q": _rejection_one_hot_q,
}

# name, drafts, target argmax (n_b + 1 per request), expected emitted tokens per request
CASES = [
    ("perfect_match", [[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    ("first_token_mismatch", [[1, 2, 3]], [[5, 2, 3, 4]], [[5]]),
    ("early_mismatch", [[1, 2, 3, 4]], [[1, 5, 3, 4, 6]], [[1, 5]]),
    ("late_mismatch", [[1, 2, 3]], [[1, 2, 7, 4]], [[1, 2, 7]]),
    ("all_accepted_bonus", [[4, 4]], [[4, 4, 8]], [[4, 4, 8]]),
    ("match_after_mismatch_not_accepted", [[1, 2, 3]], [[1, 6, 3, 4]], [[1, 6]]),
    ("empty_draft", [[]], [[7]], [[7]]),
    ("single_token_draft_accepted", [[3]], [[3, 2]], [[3, 2]]),
    ("eos_in_draft", [[1, EOS, 3]], [[1, EOS, 3, 4]], [[1, EOS, 3, 4]]),
    ("eos_as_recovered", [[1, 2]], [[1, EOS, 5]], [[1, EOS]]),
    (
        "mixed_batch",
        [[1, 2, 3], [5], [], [2, 2], [6, 6, 6]],
        [[1, 2, 3, 8], [6, 1], [3], [2, 4, 1], [6, 6, 0, 2]],
        [[1, 2, 3, 8], [6], [3], [2, 4], [6, 6, 0]],
    ),
    ("all_empty_batch", [[], []], [[1], [2]], [[1], [2]]),
]


@pytest.mark.parametrize("rule", RULES.values(), ids=RULES.keys())
@pytest.mark.parametrize(
    "drafts,target,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_named_cases(rule, drafts, target, expected) -> None:
    draft_ids, logits = _batch(drafts, target)
    out = rule(draft_ids, logits, None)
    n = draft_ids.shape[1]
    assert out.output_token_ids.shape == (len(drafts), n + 1)
    assert out.output_token_ids.dtype == torch.int64 and out.num_accepted.dtype == torch.int64
    assert [out.tokens(b) for b in range(len(drafts))] == expected
    assert out.num_emitted.tolist() == [len(e) for e in expected]
    assert out.num_accepted.tolist() == [len(e) - 1 for e in expected]
    # Placeholders fill the rest of every row.
    want = _pad(expected, n + 1, PLACEHOLDER_TOKEN_ID)
    assert torch.equal(out.output_token_ids, want)
    # Explicit draft_lens give the same result as inferring them from the placeholders.
    lens = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    assert torch.equal(rule(draft_ids, logits, lens).output_token_ids, out.output_token_ids)


def test_explicit_draft_lens_ignore_entries_past_the_draft() -> None:
    # Request 0 has draft length 1; entries 2, 3 past it are garbage, not placeholders.
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _, logits = _batch([[1, 2, 3], [4, 5, 6]], [[1, 2, 3, 0], [4, 5, 6, 7]])
    logits[0, 1] = 0.0
    logits[0, 1, 8] = 10.0  # the bonus position for draft length 1
    out = greedy_accept(drafts, logits, torch.tensor([1, 3]))
    assert out.output_token_ids.tolist() == [[1, 8, -1, -1], [4, 5, 6, 7]]
    assert out.num_accepted.tolist() == [1, 3]


def test_eos_in_draft_then_truncate() -> None:
    drafts, logits = _batch([[1, EOS, 3]], [[1, EOS, 3, 4]])
    out = greedy_accept(drafts, logits)
    tokens = out.tokens(0)
    assert tokens == [1, EOS, 3, 4]  # the accept rule does not know about EOS
    assert tokens[: truncate_at_stop(tokens, [EOS])] == [1, EOS]


STOP_CASES = [
    ("no_stop", [1, 2, 3], [9], 3),
    ("stop_in_middle", [1, 9, 3], [9], 2),
    ("stop_first", [9, 1], [9], 1),
    ("stop_last", [1, 2, 9], [9], 3),
    ("first_of_several_stops", [1, 8, 9], [9, 8], 2),
    ("empty", [], [9], 0),
    ("no_stop_ids", [1, 9], [], 2),
]


@pytest.mark.parametrize(
    "tokens,stops,keep", [c[1:] for c in STOP_CASES], ids=[c[0] for c in STOP_CASES]
)
def test_truncate_at_stop(tokens: list[int], stops: list[int], keep: int) -> None:
    assert truncate_at_stop(tokens, stops) == keep
    assert truncate_at_stop(torch.tensor(tokens, dtype=torch.int64), iter(stops)) == keep


# ---------------------------------------------------------------------------- validation

BAD_INPUTS = [
    ("placeholder_not_a_suffix", dict(drafts=[[1, -1, 3]]), "prefix"),
    ("draft_one_dimensional", dict(drafts=[1, 2]), "draft_token_ids"),
    ("draft_float", dict(drafts=[[1.0, 2.0]]), "integer"),
    ("target_too_short", dict(drafts=[[1, 2]], target_shape=(1, 2, VOCAB)), "target_logits"),
    ("target_batch_mismatch", dict(drafts=[[1, 2]], target_shape=(2, 3, VOCAB)), "target_logits"),
    ("draft_lens_too_long", dict(drafts=[[1, 2]], lens=[3]), "draft_lens"),
    ("draft_lens_negative", dict(drafts=[[1, 2]], lens=[-1]), "draft_lens"),
    ("draft_lens_shape", dict(drafts=[[1, 2]], lens=[1, 1]), "draft_lens"),
    ("draft_id_out_of_vocab", dict(drafts=[[1, VOCAB]]), "vocab"),
    ("placeholder_inside_draft_lens", dict(drafts=[[1, -1]], lens=[2]), "vocab"),
]


@pytest.mark.parametrize("kw,match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_greedy_accept_validates(kw: dict, match: str) -> None:
    drafts = torch.tensor(kw["drafts"])
    n = drafts.shape[-1]
    shape = kw.get("target_shape", (1, n + 1, VOCAB))
    lens = torch.tensor(kw["lens"]) if "lens" in kw else None
    with pytest.raises(ValueError, match=match):
        greedy_accept(drafts, torch.zeros(shape), lens)


def test_rejection_and_coupled_validate() -> None:
    drafts = torch.tensor([[1, 2]])
    probs = torch.full((1, 3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample_accept(drafts, torch.zeros(1, 3, VOCAB), probs)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample_accept(drafts, None, probs[:, :2])
    with pytest.raises(ValueError, match="generators"):
        rejection_sample_accept(drafts, None, probs, generators=[torch.Generator()] * 2)
    with pytest.raises(ValueError, match="noise"):
        coupled_accept(drafts, probs, torch.zeros(1, 3, VOCAB + 1))


# ------------------------------------------------------------------- rejection sampling


def _random_probs(gen: torch.Generator, *shape: int, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=gen) * scale, dim=-1)


def test_identical_p_and_q_accept_everything() -> None:
    gen = torch.Generator().manual_seed(10)
    batch, n = 2000, 4
    q = _random_probs(gen, batch, n, VOCAB)
    p = torch.cat([q, _random_probs(gen, batch, 1, VOCAB)], dim=1)
    drafts = sample_from_probs(q.reshape(-1, VOCAB), gen).reshape(batch, n)
    out = rejection_sample_accept(drafts, q, p, generators=gen)
    assert (out.num_accepted == n).all()
    assert torch.equal(out.output_token_ids[:, :n], drafts)


def test_disjoint_supports_reject_at_position_zero() -> None:
    gen = torch.Generator().manual_seed(11)
    batch, n = 2000, 3
    q = torch.zeros(batch, n, VOCAB)
    q[..., 5:] = _random_probs(gen, batch, n, VOCAB - 5)
    p = torch.zeros(batch, n + 1, VOCAB)
    p[..., :5] = _random_probs(gen, batch, n + 1, 5)
    drafts = sample_from_probs(q.reshape(-1, VOCAB), gen).reshape(batch, n)
    out = rejection_sample_accept(drafts, q, p, generators=gen)
    assert (out.num_accepted == 0).all()
    assert (out.output_token_ids[:, 0] < 5).all()  # recovered from the target's support
    assert (out.output_token_ids[:, 1:] == PLACEHOLDER_TOKEN_ID).all()


def test_point_mass_drafts() -> None:
    # p one-hot at the draft => accepted; p(d) == 0 => rejected and recovered from p.
    drafts = torch.tensor([[3, 4], [3, 4]])
    p = torch.zeros(2, 3, VOCAB)
    p[0, 0, 3] = p[0, 1, 4] = p[0, 2, 7] = 1.0
    p[1, 0, 3] = 1.0
    p[1, 1, 1] = p[1, 1, 2] = 0.5
    p[1, 2, 7] = 1.0
    out = rejection_sample_accept(drafts, None, p, generators=torch.Generator().manual_seed(0))
    assert out.tokens(0) == [3, 4, 7]
    assert out.tokens(1)[:1] == [3] and out.tokens(1)[1] in (1, 2)


def test_draft_with_zero_q_is_rejected() -> None:
    # q(d) == 0: d cannot have come from q; the rule rejects it even though p(d) == 1.
    drafts = torch.tensor([[2]])
    q = torch.zeros(1, 1, VOCAB)
    q[0, 0, 5] = 1.0
    p = torch.zeros(1, 2, VOCAB)
    p[0, 0, 2] = p[0, 1, 0] = 1.0
    out = rejection_sample_accept(drafts, q, p, generators=torch.Generator().manual_seed(0))
    assert out.num_accepted.tolist() == [0]
    assert out.tokens(0) == [2]  # recovered from max(p - q, 0) = p


def test_zero_residual_falls_back_to_target() -> None:
    # q >= p everywhere (here q = 2p, unnormalized) leaves max(p - q, 0) == 0 at a rejection:
    # the recovered token is then drawn from p, never from outside its support.
    gen = torch.Generator().manual_seed(12)
    batch = 50_000
    p_row = torch.tensor([0.0, 0.4, 0.0, 0.35, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0])
    p = p_row.expand(batch, 2, VOCAB).contiguous()
    q = 2 * p[:, :1]
    drafts = sample_from_probs(p[:, 0], gen).unsqueeze(1)
    out = rejection_sample_accept(drafts, q, p, generators=gen)
    rejected = out.num_accepted == 0
    assert 0.4 < rejected.float().mean() < 0.6  # acceptance probability min(1, p / q) = 0.5
    _assert_distribution(out.output_token_ids[rejected, 0], p_row)


def _seeded_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = _random_probs(gen, 4, 3, VOCAB, scale=0.5)
    p = _random_probs(gen, 4, 4, VOCAB, scale=0.5)
    drafts = sample_from_probs(q.reshape(-1, VOCAB), gen).reshape(4, 3)
    drafts[1, 2] = drafts[3, 1:] = PLACEHOLDER_TOKEN_ID  # draft lengths 3, 2, 3, 1
    return drafts, q, p


def test_seeded_determinism_one_generator() -> None:
    drafts, q, p = _seeded_case(13)
    runs = [
        rejection_sample_accept(drafts, q, p, generators=torch.Generator().manual_seed(s))
        .output_token_ids
        for s in (5, 5, 6, 7, 8)
    ]
    assert torch.equal(runs[0], runs[1])
    assert any(not torch.equal(runs[0], r) for r in runs[2:])


def test_per_request_generator_independent_of_batch() -> None:
    drafts, q, p = _seeded_case(14)
    seeds = [100, 101, 102, 103]

    def run(rows: list[int], width: int) -> AcceptOutput:
        # Re-pad the chosen requests to `width` drafts: max_num_drafts changes with the batch.
        d = torch.full((len(rows), width), PLACEHOLDER_TOKEN_ID)
        qq = torch.full((len(rows), width, VOCAB), 1.0 / VOCAB)
        pp = torch.full((len(rows), width + 1, VOCAB), 1.0 / VOCAB)
        for i, r in enumerate(rows):
            n_r = int((drafts[r] != PLACEHOLDER_TOKEN_ID).sum())
            d[i, :n_r], qq[i, :n_r], pp[i, : n_r + 1] = drafts[r, :n_r], q[r, :n_r], p[r, : n_r + 1]
        gens = [torch.Generator().manual_seed(seeds[r]) for r in rows]
        return rejection_sample_accept(d, qq, pp, generators=gens)

    full = run([0, 1, 2, 3], 3)
    for rows, width in [([3], 1), ([1, 3], 2), ([2, 0], 3), ([3, 1, 0], 5)]:
        sub = run(rows, width)
        for i, r in enumerate(rows):
            assert sub.tokens(i) == full.tokens(r), f"request {r} in batch {rows}"


# ----------------------------------------------------------------- statistical tests


def _fit(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(chi-square p-value on p's support, TV distance, samples outside p's support)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).numpy()
    probs = probs.double().numpy()
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    p_value = stats.chisquare(counts[support], expected).pvalue
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    return float(p_value), float(tv), int(counts[~support].sum())


def _assert_distribution(tokens: torch.Tensor, probs: torch.Tensor, tv_max: float = 0.015) -> None:
    p_value, tv, outside = _fit(tokens, probs)
    assert outside == 0, f"{outside} samples outside the target's support"
    assert p_value > P_VALUE_MIN, f"chi-square p-value {p_value:.2e}"
    assert tv < tv_max, f"TV distance {tv:.4f}"


STAT_VOCAB = 12
STAT_BATCH = 100_000


def _stat_dists(
    seed: int, positions: int, sparse_target: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed draft dists q [positions, V] and target dists p [positions + 1, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = _random_probs(gen, positions, STAT_VOCAB)
    logits = torch.randn(positions + 1, STAT_VOCAB, generator=gen) * 1.5
    p = torch.softmax(process_logits(logits, 1.0, 5 if sparse_target else -1, 1.0), -1)
    return q, p


def _draw_drafts(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # -> [batch, positions]
    columns = [sample_from_probs(q[j].expand(STAT_BATCH, -1), gen) for j in range(len(q))]
    return torch.stack(columns, 1)


@pytest.mark.parametrize("sparse_target", [False, True], ids=["dense_target", "top_k_target"])
def test_first_token_distribution_is_target(sparse_target: bool) -> None:
    q, p = _stat_dists(20, 1, sparse_target)
    gen = torch.Generator().manual_seed(21)
    drafts = _draw_drafts(q, gen)
    out = rejection_sample_accept(
        drafts, q.expand(STAT_BATCH, -1, -1), p.expand(STAT_BATCH, -1, -1), generators=gen
    )
    _assert_distribution(out.output_token_ids[:, 0], p[0])
    # The bonus token (when the draft is accepted) comes from the last target position.
    bonus = out.num_accepted == 1
    _assert_distribution(out.output_token_ids[bonus, 1], p[1], tv_max=0.02)


def test_second_token_distribution_is_target() -> None:
    # Two drafts; every target distribution is fixed (independent of the prefix), so the
    # second emitted token, given the first draft was accepted, must follow p[1], and the
    # bonus after two accepted drafts must follow p[2].
    q, p = _stat_dists(30, 2)
    gen = torch.Generator().manual_seed(31)
    drafts = _draw_drafts(q, gen)
    out = rejection_sample_accept(
        drafts, q.expand(STAT_BATCH, -1, -1), p.expand(STAT_BATCH, -1, -1), generators=gen
    )
    first = out.output_token_ids[:, 0]
    second = out.output_token_ids[out.num_accepted >= 1, 1]
    bonus = out.output_token_ids[out.num_accepted == 2, 2]
    assert len(second) > 20_000 and len(bonus) > 5_000
    _assert_distribution(first, p[0])
    _assert_distribution(second, p[1], tv_max=0.02)
    _assert_distribution(bonus, p[2], tv_max=0.04)


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_point_mass_distribution_is_target(drafter: str) -> None:
    # The rule gets no draft probabilities, whatever the drafter's distribution was.
    q, p = _stat_dists(40, 1)
    gen = torch.Generator().manual_seed(41)
    if drafter == "sampled":
        drafts = _draw_drafts(q, gen)
    else:
        drafts = torch.full((STAT_BATCH, 1), int(q[0].argmax()))
    out = rejection_sample_accept(drafts, None, p.expand(STAT_BATCH, -1, -1), generators=gen)
    _assert_distribution(out.output_token_ids[:, 0], p[0])


def test_per_request_generators_distribution_is_target() -> None:
    q, p = _stat_dists(50, 1)
    batch = 4000
    drafts = sample_from_probs(q[0].expand(batch, -1), torch.Generator().manual_seed(51))
    gens = [torch.Generator().manual_seed(1000 + b) for b in range(batch)]
    out = rejection_sample_accept(
        drafts.unsqueeze(1), q.expand(batch, -1, -1), p.expand(batch, -1, -1), generators=gens
    )
    _assert_distribution(out.output_token_ids[:, 0], p[0], tv_max=0.06)


def test_negative_controls_detect_wrong_rules() -> None:
    # The same check rejects (a) accepting every draft and (b) rejection sampling told the
    # wrong draft distribution (uniform), so the statistical tests above can fail.
    q, p = _stat_dists(20, 1)
    gen = torch.Generator().manual_seed(21)
    drafts = _draw_drafts(q, gen)
    p_value, tv, _ = _fit(drafts[:, 0], p[0])  # accept-always emits the draft itself
    assert p_value < 1e-12 and tv > 0.05
    wrong_q = torch.full((STAT_BATCH, 1, STAT_VOCAB), 1.0 / STAT_VOCAB)
    out = rejection_sample_accept(drafts, wrong_q, p.expand(STAT_BATCH, -1, -1), generators=gen)
    p_value, tv, _ = _fit(out.output_token_ids[:, 0], p[0])
    assert p_value < 1e-12 and tv > 0.02
    # (c) sampling the recovered token from p instead of the residual is also caught.
    ratio = (p[0, drafts[:, 0]] / q[0, drafts[:, 0]]).clamp_max(1)
    accepted = torch.rand(STAT_BATCH, generator=gen) < ratio
    fresh = sample_from_probs(p[0].expand(STAT_BATCH, -1), gen)
    p_value, _, _ = _fit(torch.where(accepted, drafts[:, 0], fresh), p[0])
    assert p_value < 1e-12


# ----------------------------------------------------------------------- coupled accept


def _coupled_ar(logits: torch.Tensor, seed: int, start: int = 0) -> list[int]:
    """Seeded AR decoding: one coupled sample per absolute position (logits [T, V])."""
    noise = position_gumbel_noise(seed, torch.arange(start, start + len(logits)), logits.shape[-1])
    return coupled_sample(logits, noise).tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 8, 0.9), (0.0, -1, 1.0)])
def test_coupled_accept_equals_coupled_ar(temperature: float, top_k: int, top_p: float) -> None:
    # The target's logits at each position do not depend on the prefix, so AR decoding is
    # one coupled sample per position. Speculative decoding drafts partly-right tokens.
    gen = torch.Generator().manual_seed(60)
    total, vocab, seed = 60, 16, 61
    logits = process_logits(torch.randn(total, vocab, generator=gen) * 2, temperature, top_k, top_p)
    ar = _coupled_ar(logits, seed)
    emitted: list[int] = []
    accepted_counts = []
    while len(emitted) < total - 5:
        pos = len(emitted)
        n = int(torch.randint(0, 5, (1,), generator=gen))
        draft = list(ar[pos : pos + n])
        for j in range(n):  # corrupt some drafts
            if float(torch.rand(1, generator=gen)) < 0.25:
                draft[j] = int(torch.randint(0, vocab, (1,), generator=gen))
        noise = position_gumbel_noise(seed, torch.arange(pos, pos + n + 1), vocab)
        draft_ids = torch.tensor([draft], dtype=torch.int64).reshape(1, n)
        out = coupled_accept(draft_ids, logits[None, pos : pos + n + 1], noise[None])
        step = out.tokens(0)
        agree = next((j for j in range(n) if draft[j] != ar[pos + j]), n)
        assert out.num_accepted.item() == agree
        assert step == ar[pos : pos + len(step)], f"step at position {pos}"
        accepted_counts.append(agree)
        emitted += step
    assert emitted == ar[: len(emitted)]
    assert max(accepted_counts) >= 3 and min(accepted_counts) == 0  # both regimes exercised


def test_coupled_accept_batch_matches_per_request_ar() -> None:
    # Three requests with their own seeds, start positions and draft lengths, one batch.
    gen = torch.Generator().manual_seed(70)
    vocab = 16
    seeds, starts, lens = [1, 2, 3], [0, 37, 5], [4, 0, 2]
    logits = [process_logits(torch.randn(8, vocab, generator=gen), 0.9, -1, 1.0) for _ in seeds]
    ars = [_coupled_ar(lg, s, start) for lg, s, start in zip(logits, seeds, starts)]
    drafts = [ars[0][:4], [], [ars[2][0], (ars[2][1] + 1) % vocab]]  # right, empty, partly right
    n = max(lens)
    target = torch.zeros(3, n + 1, vocab)
    noise = torch.zeros(3, n + 1, vocab)
    for b in range(3):
        target[b] = logits[b][: n + 1]
        positions = torch.arange(starts[b], starts[b] + n + 1)
        noise[b] = position_gumbel_noise(seeds[b], positions, vocab)
    out = coupled_accept(_pad(drafts, n, PLACEHOLDER_TOKEN_ID), target, noise)
    assert out.num_accepted.tolist() == [4, 0, 1]
    for b in range(3):
        assert out.tokens(b) == ars[b][: out.num_emitted[b]]
