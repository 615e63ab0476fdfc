"""Goodness of fit for sampled sequences: is a sampler's output law the exact one?

The lossless-sampling tests draw N sequences, compute each sequence's exact probability
under the target model (:func:`sequence_probabilities`), and run a Pearson chi-square test
(:func:`chi_square_test`): a cell per sequence expected at least ``min_expected`` times,
every other sequence (rarer, unseen, never enumerated) pooled into one cell, so the
statistic is chi-square distributed under the null. A correct sampler then fails with
probability ``p_min`` over seed sets; with fixed seeds the test is deterministic.

Cells are keyed by anything hashable (token tuples, or the flat index of a tensor cell:
:func:`chi_square_test` accepts two arrays of the same shape too).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ChiSquareResult", "chi_square_test", "lm_next_probs", "sequence_probabilities"]


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    dof: int
    pvalue: float
    observed: tuple[float, ...]  # per cell, the pooled cell last (when there is one)
    expected: tuple[float, ...]

    def __str__(self) -> str:
        return (f"chi2={self.statistic:.1f} over {len(self.observed)} cells "
                f"(dof {self.dof}), p={self.pvalue:.3g}")


def _as_mapping(x: Any) -> Mapping[Hashable, float]:
    if isinstance(x, Mapping):
        return x
    if hasattr(x, "flatten") and hasattr(x, "tolist"):  # torch / numpy arrays: flat cells
        return dict(enumerate(x.flatten().tolist()))
    if isinstance(x, Iterable):  # samples: count them
        return Counter(tuple(s) if isinstance(s, list) else s for s in x)
    raise TypeError(f"cannot read cells from {type(x).__name__}")


def chi_square_test(observed: Any, probs: Any, num_samples: int | None = None, *,
                    min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson chi-square goodness of fit of ``observed`` to the exact law ``probs``.

    ``observed``: counts by cell (a mapping), the samples themselves (an iterable of
    sequences: counted), or an array of counts; ``probs``: exact probability by cell (a
    mapping, or an array shaped like ``observed``); the probabilities need not cover the
    whole law (the missing mass goes to the pooled cell). ``num_samples`` defaults to the
    number of observations. Cells expected at least ``min_expected`` times are kept; the
    rest of the law, together with every observation outside the kept cells, is one pooled
    cell (merged into the smallest kept cell when expected fewer than ``min_expected`` times;
    an observation where the law has no mass at all gives p = 0)."""
    from scipy.stats import chi2

    counts, p = _as_mapping(observed), _as_mapping(probs)
    n = float(sum(counts.values()) if num_samples is None else num_samples)
    cells = [c for c, q in p.items() if q * n >= min_expected]
    obs = [float(counts.get(c, 0)) for c in cells]
    exp = [float(p[c]) * n for c in cells]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= min_expected or (rest_exp > 1e-9 * n and not cells):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 1e-9 * n:  # a pooled cell too small on its own: merge it into the smallest
        i = min(range(len(exp)), key=exp.__getitem__)
        obs[i] += rest_obs
        exp[i] += rest_exp
    elif rest_obs > 0.5:  # observations where the law has no mass: impossible under the null
        return ChiSquareResult(float("inf"), max(1, len(cells) - 1), 0.0,
                               (*obs, rest_obs), (*exp, 0.0))
    if len(obs) < 2:
        raise ValueError("fewer than two cells: nothing to test (more samples, or a law "
                         "with more mass per sequence)")
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    return ChiSquareResult(float(stat), dof, float(chi2.sf(stat, dof)), tuple(obs), tuple(exp))


def sequence_probabilities(next_probs: Callable[[tuple[int, ...]], Any],
                           sequences: Iterable[Iterable[int]]) -> dict[tuple[int, ...], float]:
    """Exact probability of each sequence, ``prod_i next_probs(seq[:i])[seq[i]]``.

    ``next_probs(prefix)`` is the law of the next token after ``prompt + prefix`` (e.g.
    softmax of the processed logits of the target model); it is called once per distinct
    prefix. See :func:`lm_next_probs` for a model with temperature / top-k / top-p."""
    cache: dict[tuple[int, ...], Any] = {}

    def probs(prefix: tuple[int, ...]) -> Any:
        if prefix not in cache:
            cache[prefix] = next_probs(prefix)
        return cache[prefix]

    out: dict[tuple[int, ...], float] = {}
    for seq in sequences:
        seq = tuple(seq)
        value = 1.0
        for i, token in enumerate(seq):
            value *= float(probs(seq[:i])[token])
        out[seq] = value
    return out


def lm_next_probs(lm, prompt: list[int], temperature: float, top_k: int = -1,
                  top_p: float = 1.0) -> Callable[[tuple[int, ...]], Any]:
    """``next_probs`` for :func:`sequence_probabilities`: an AR model's next-token law
    after ``prompt + prefix`` under diffspec's sampling (temperature, then top-k, then
    top-p: :func:`diffspec.core.sampling.process_logits`)."""
    import torch

    from diffspec.core.sampling import process_logits

    def next_probs(prefix: tuple[int, ...]) -> Any:
        with torch.no_grad():
            logits = lm(torch.tensor([list(prompt) + list(prefix)])).logits[0, -1]
        return torch.softmax(process_logits(logits, temperature, top_k, top_p), -1)

    return next_probs
