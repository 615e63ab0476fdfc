"""diffspec.testing.stats: the chi-square test the lossless-sampling tests share has the
right size and power, pools rare cells, and computes exact sequence probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffspec.testing.stats import chi_square_test, lm_next_probs, sequence_probabilities

# A law over token sequences with a long tail (many cells expected < 5 at n = 400).
LAW = {(1,): 0.4, (2, 1): 0.25, (2, 2): 0.15, **{(3, t): 0.2 / 40 for t in range(40)}}


def _draw(law: dict, n: int, seed: int) -> list[tuple]:
    keys = list(law)
    idx = np.random.default_rng(seed).choice(len(keys), size=n, p=list(law.values()))
    return [keys[i] for i in idx]


def test_a_correct_sampler_passes_at_the_nominal_rate() -> None:
    pvalues = [chi_square_test(_draw(LAW, 400, seed), LAW).pvalue for seed in range(200)]
    # under the null p is uniform: about 5% below 0.05, none absurdly small
    assert 0.01 <= np.mean(np.array(pvalues) < 0.05) <= 0.11
    result = chi_square_test(_draw(LAW, 400, 0), LAW, 400)
    assert result.dof == 3  # 3 cells kept + the pooled tail, minus one
    assert sum(result.observed) == 400 and sum(result.expected) == pytest.approx(400)


def test_a_wrong_law_fails() -> None:
    wrong = {**LAW, (2, 1): 0.2, (2, 2): 0.2}  # 0.05 of mass moved
    assert chi_square_test(_draw(wrong, 2000, 1), LAW).pvalue < 1e-3
    # samples the law gives no mass at all: impossible, p = 0
    assert chi_square_test([(1,)] * 50 + [(9, 9)], {(1,): 1.0}).pvalue == 0.0


def test_unenumerated_mass_and_arrays() -> None:
    # probabilities for the seen sequences only: the rest of the law is the pooled cell
    samples = _draw(LAW, 500, 2)
    seen = {s: LAW[s] for s in set(samples)}
    assert chi_square_test(samples, seen, 500).pvalue == pytest.approx(
        chi_square_test(samples, LAW, 500).pvalue)
    # tensors of counts and probabilities (e.g. a [vocab, vocab] joint of two tokens)
    probs = torch.tensor([[0.3, 0.1], [0.2, 0.4]])
    counts = torch.tensor([[31.0, 9.0], [18.0, 42.0]])
    result = chi_square_test(counts, probs, 100)
    assert result.dof == 3 and result.pvalue > 0.5
    assert chi_square_test(3 * counts, probs.T, 300).pvalue < 1e-3
    # a tiny pooled cell is merged into the smallest kept cell, not tested on its own
    law = {(0,): 0.6, (1,): 0.37, (2,): 0.03}
    result = chi_square_test({(0,): 58, (1,): 38, (2,): 4}, law, 100)
    assert result.dof == 1 and result.expected == pytest.approx((60.0, 40.0))
    assert result.observed == (58.0, 42.0)
    with pytest.raises(ValueError, match="fewer than two cells"):
        chi_square_test({(0,): 97, (1,): 3}, {(0,): 0.97, (1,): 0.03}, 100)


def test_sequence_probabilities_chain_the_next_token_laws() -> None:
    calls = []

    def next_probs(prefix: tuple) -> list[float]:
        calls.append(prefix)
        return [0.5, 0.5] if not prefix else [0.9, 0.1] if prefix[-1] == 0 else [0.2, 0.8]

    probs = sequence_probabilities(next_probs, [(0, 0), (0, 1), [1, 1], (1, 1)])
    assert probs == pytest.approx({(0, 0): 0.45, (0, 1): 0.05, (1, 1): 0.4})
    assert sorted(calls) == [(), (0,), (1,)]  # one call per distinct prefix


def test_lm_next_probs_applies_temperature_and_top_p() -> None:
    class LM:
        def __call__(self, ids):
            logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(1, ids.shape[1], 4)
            return type("Out", (), {"logits": logits})()

    probs = lm_next_probs(LM(), [5], temperature=1.0, top_p=0.7)(())
    full = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), -1)
    assert probs[:2].sum() == 0 and probs.sum() == pytest.approx(1.0)
    assert probs[3] / probs[2] == pytest.approx(float(full[3] / full[2]))
