"""Sampling rules: parameter validation, logits processing (vs a brute-force reference),
seeded sampling, and position-keyed Gumbel noise for coupled sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from diffspec.core.sampling import (
    SamplingParams,
    coupled_sample,
    position_gumbel_noise,
    probs_from_logits,
    process_logits,
    sample_from_probs,
)

NEG_INF = float("-inf")
P_VALUE_MIN = 1e-3  # statistical tests use fixed seeds, so they are deterministic


def _counts(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return torch.bincount(tokens, minlength=vocab).numpy()


def _assert_distribution(tokens: torch.Tensor, probs: torch.Tensor, tv_max: float = 0.015) -> None:
    """Chi-square goodness of fit on the support, nothing outside it, and a TV bound."""
    counts = _counts(tokens, probs.numel())
    probs = probs.double().numpy()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a zero-probability token"
    expected = probs[support] / probs[support].sum() * counts.sum()
    p_value = stats.chisquare(counts[support], expected).pvalue
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    assert p_value > P_VALUE_MIN, f"chi-square p-value {p_value:.2e}"
    assert tv < tv_max, f"TV distance {tv:.4f}"


# ------------------------------------------------------------------------------- params

BAD_PARAMS = [
    ("negative_temperature", dict(temperature=-0.1), "temperature"),
    ("nan_temperature", dict(temperature=float("nan")), "temperature"),
    ("inf_temperature", dict(temperature=float("inf")), "temperature"),
    ("string_temperature", dict(temperature="1.0"), "temperature"),
    ("top_k_minus_5", dict(top_k=-5), "top_k"),
    ("float_top_k", dict(top_k=2.5), "top_k"),
    ("bool_top_k", dict(top_k=True), "top_k"),
    ("top_p_zero", dict(top_p=0.0), "top_p"),
    ("top_p_above_one", dict(top_p=1.5), "top_p"),
    ("top_p_negative", dict(top_p=-0.5), "top_p"),
    ("nan_top_p", dict(top_p=float("nan")), "top_p"),
    ("negative_seed", dict(seed=-1), "seed"),
    ("float_seed", dict(seed=1.5), "seed"),
]


@pytest.mark.parametrize(
    "kwargs,field", [c[1:] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS]
)
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_good_sampling_params() -> None:
    assert SamplingParams().is_greedy
    assert SamplingParams(top_k=0, top_p=1.0, seed=0).is_greedy
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1234)
    assert not params.is_greedy
    assert SamplingParams(temperature=1, top_k=-1).temperature == 1
    with pytest.raises(Exception):
        params.temperature = 0.0  # type: ignore[misc]  # frozen


def test_process_logits_validates_scalars() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits, -1.0, -1, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits, 1.0, -1, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(logits, 1.0, -5, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(logits, 1.0, torch.tensor([1, 2, 3]), 1.0)  # not a prefix of [2]


# ---------------------------------------------------------------------- logits processing


def test_temperature_scales() -> None:
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(process_logits(logits, 2.0, -1, 1.0), logits / 2)


def test_greedy_is_one_hot() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0]])  # tie: the first argmax wins
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_top_k_keeps_exactly_k_on_ties() -> None:
    logits = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0]])
    out = process_logits(logits, 1.0, 2, 1.0)
    # Ties are broken by the lower token index.
    assert torch.isfinite(out).tolist() == [[True, False, True, False, False]]


@pytest.mark.parametrize("top_k", [-1, 0, 5, 100])
def test_top_k_off(top_k: int) -> None:
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(process_logits(logits, 1.0, top_k, 1.0), logits)


def test_top_p_smallest_set() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125 (powers of two: exact cumulative sums)
    logits = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    keep = lambda p: torch.isfinite(process_logits(logits, 1.0, -1, p))[0].tolist()
    assert keep(0.3) == [False, True, False, False]  # top-1 alone reaches 0.3
    assert keep(0.5) == [False, True, False, False]  # cumulative >= top_p is enough
    assert keep(0.6) == [False, True, False, True]
    assert keep(0.8) == [True, True, False, True]  # tie at 0.125: the lower index
    assert keep(0.01) == [False, True, False, False]  # always at least the top-1
    assert keep(1.0) == [True, True, True, True]


def test_temperature_applies_before_top_p() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    assert torch.isfinite(process_logits(logits, 1.0, -1, 0.9)).all()
    # At temperature 0.1 the top token has ~98% of the mass, so top_p 0.9 keeps only it.
    assert torch.isfinite(process_logits(logits, 0.1, -1, 0.9))[0].tolist() == [True, False]


def test_top_k_applies_before_top_p() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k=2 renormalizes to 4/7, 3/7; top_p 0.5 then keeps only the first.
    kept = torch.isfinite(process_logits(logits, 1.0, 2, 0.5))[0].tolist()
    assert kept == [True, False, False, False]


def _reference_row(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[bool]:
    """Brute force: which tokens survive, by the documented rule, one row in pure Python."""
    vocab = len(logits)
    if temperature == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [i == best for i in range(vocab)]
    scaled = [x / temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    if 0 < top_k < vocab:
        order = order[:top_k]
    m = max(scaled[i] for i in order)
    weights = [math.exp(scaled[i] - m) for i in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights):
        kept.append(i)
        mass += w / total
        if top_p < 1.0 and mass >= top_p:
            break
    return [i in kept for i in range(vocab)]


def test_process_logits_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 300, 9
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[:20, 3] = logits[:20, 5]  # some ties
    temperature = torch.rand(rows, generator=gen) * 2
    temperature[::7] = 0.0  # greedy rows mixed in
    top_k = torch.randint(-1, vocab + 2, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.98 + 0.02
    top_p[::5] = 1.0
    out = process_logits(logits, temperature, top_k, top_p)
    for r in range(rows):
        t, k, p = float(temperature[r]), int(top_k[r]), float(top_p[r])
        kept = torch.isfinite(out[r])
        assert kept.tolist() == _reference_row(logits[r].tolist(), t, k, p), f"row {r}"
        if t > 0:
            torch.testing.assert_close(out[r][kept], logits[r][kept] / t)


def test_per_row_params_broadcast_over_positions() -> None:
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.0, 0.5])  # [batch]: one value per request
    out = process_logits(logits, temperature, torch.tensor([-1, 2]), torch.tensor([1.0, 1.0]))
    assert (torch.isfinite(out[0]).sum(-1) == 1).all()
    assert (torch.isfinite(out[1]).sum(-1) == 2).all()
    torch.testing.assert_close(out[1], process_logits(logits[1], 0.5, 2, 1.0))


def test_probs_sum_to_one() -> None:
    logits = torch.randn(4, 7, 11, generator=torch.Generator().manual_seed(3))
    probs = probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=5, top_p=0.7))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 7))


# ---------------------------------------------------------------------------- sampling


def test_sample_from_probs_is_seeded() -> None:
    probs = torch.softmax(torch.randn(64, 10, generator=torch.Generator().manual_seed(4)), -1)
    a = sample_from_probs(probs, torch.Generator().manual_seed(7))
    b = sample_from_probs(probs, torch.Generator().manual_seed(7))
    c = sample_from_probs(probs, torch.Generator().manual_seed(8))
    assert a.dtype == torch.int64 and a.shape == (64,)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_from_probs_distribution() -> None:
    probs = torch.tensor([0.05, 0.0, 0.3, 0.15, 0.0, 0.5])
    tokens = sample_from_probs(probs.expand(100_000, -1), torch.Generator().manual_seed(5))
    _assert_distribution(tokens, probs)


def test_sample_from_probs_one_hot() -> None:
    probs = torch.eye(5)
    assert sample_from_probs(probs, torch.Generator().manual_seed(0)).tolist() == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------ coupled noise


def test_noise_is_reproducible_and_independent_of_grouping() -> None:
    full = position_gumbel_noise(11, torch.arange(10), 32)
    assert full.shape == (10, 32) and full.dtype == torch.float32
    assert torch.equal(full, position_gumbel_noise(11, torch.arange(10), 32))
    assert torch.equal(position_gumbel_noise(11, torch.tensor([3, 4, 5]), 32), full[3:6])
    assert torch.equal(position_gumbel_noise(11, [7, 2], 32), full[[7, 2]])
    assert not torch.equal(position_gumbel_noise(12, torch.arange(10), 32), full)
    # A larger vocab extends the rows: noise is keyed on the token index too.
    assert torch.equal(position_gumbel_noise(11, torch.arange(10), 40)[:, :32], full)


def test_noise_large_seed_and_position() -> None:
    big = position_gumbel_noise(2**63 + 5, torch.tensor([2**40 + 1, 2**40 + 2]), 16)
    assert torch.isfinite(big).all()
    assert not torch.equal(big[0], big[1])
    with pytest.raises(ValueError, match="positions"):
        position_gumbel_noise(0, torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="seed"):
        position_gumbel_noise(-3, torch.tensor([0]), 4)


def test_noise_is_gumbel() -> None:
    noise = position_gumbel_noise(0, torch.arange(2000), 100).flatten().double().numpy()
    assert stats.kstest(noise, stats.gumbel_r.cdf).pvalue > P_VALUE_MIN
    # Neighbouring tokens and neighbouring positions are uncorrelated.
    grid = noise.reshape(2000, 100)
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(grid[:-1].ravel(), grid[1:].ravel())[0, 1]) < 0.01


def test_coupled_sample_marginal_over_positions() -> None:
    logits = process_logits(torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5, 0.7]), 1.0, 6, 1.0)
    n = 60_000
    noise = position_gumbel_noise(3, torch.arange(n), 8)
    tokens = coupled_sample(logits.expand(n, -1), noise)
    _assert_distribution(tokens, torch.softmax(logits, -1))


def test_coupled_sample_marginal_over_seeds() -> None:
    logits = torch.tensor([[0.5, -0.2, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits[0], -1)
    tokens = torch.cat([
        coupled_sample(logits, position_gumbel_noise(seed, [17], 5)) for seed in range(4000)
    ])
    _assert_distribution(tokens, probs, tv_max=0.05)


def test_coupled_sample_greedy_row_is_argmax() -> None:
    raw = torch.randn(50, 9, generator=torch.Generator().manual_seed(6))
    logits = process_logits(raw, 0.0, -1, 1.0)
    tokens = coupled_sample(logits, position_gumbel_noise(1, torch.arange(50), 9))
    assert torch.equal(tokens, logits.argmax(-1))


def test_coupled_sample_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shape"):
        coupled_sample(torch.zeros(2, 4), torch.zeros(2, 5))


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    """SGLang's rule: ``p < min_p * p_max`` is dropped (after temperature, top-k, top-p);
    the top token always stays; ``min_p = 0`` is off; per-row values broadcast."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    out = process_logits(logits, 1.0, -1, 1.0, torch.tensor([0.3, 0.5]))
    keep = probs >= probs.max(dim=-1, keepdim=True).values * torch.tensor([[0.3], [0.5]])
    assert torch.equal(torch.isfinite(out), keep)
    assert torch.equal(out[keep], logits[keep])
    assert torch.equal(process_logits(logits, 1.0, -1, 1.0, 0.0), logits)
    # temperature first: T = 10 flattens the row, so min_p 0.3 keeps more
    hot = process_logits(logits[:1], 10.0, -1, 1.0, 0.3)
    assert torch.isfinite(hot).sum() == 4
    # greedy rows stay one-hot
    assert torch.isfinite(process_logits(logits, 0.0, -1, 1.0, 0.9)).sum() == 2
