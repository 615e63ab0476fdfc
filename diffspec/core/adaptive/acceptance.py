"""Acceptance: expected tokens of a step, acceptance per position as engines count it,
a checkpoint's measured prior, and the running estimate fed by verify outcomes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["CHECKPOINT_ACCEPTANCE_KEY", "AcceptanceEstimate", "checkpoint_prior",
           "conditional_acceptance", "expected_tokens", "measured_prior"]

# the config.json key of a checkpoint whose drafts' acceptance per position was measured
# (written by diffspec's materialize_orthrus from heads.json's acceptance_per_position)
CHECKPOINT_ACCEPTANCE_KEY = "diffspec_draft_acceptance"


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """``1 + sum_{j<=k} prod_{i<=j} a(i)``: tokens a step with ``k`` drafts commits in
    expectation (``acceptance[i]``: conditional acceptance of draft ``i + 1``)."""
    return _expected_by_count(acceptance, k)[k]


def _expected_by_count(acceptance: Sequence[float], k: int) -> list[float]:
    """``[E(0), E(1) .. E(k)]`` (:func:`expected_tokens`), in one pass."""
    totals, survive = [1.0], 1.0
    for i in range(k):
        survive *= acceptance[i] if i < len(acceptance) else 0.0
        totals.append(totals[-1] + survive)
    return totals


def conditional_acceptance(per_position: Sequence[float]) -> list[float]:
    """``a(i)`` from the acceptance per draft position as vLLM counts it
    (``num_accepted_tokens_per_pos[j] / num_drafts``: the share of verify steps in which
    drafts ``0 .. j`` were all accepted): ``a(j) = p(j) / p(j - 1)``, clamped to [0, 1]
    (0 after a position that was never reached)."""
    conditional, previous = [], 1.0
    for p in per_position:
        p = min(max(float(p), 0.0), 1.0)
        conditional.append(min(p / previous, 1.0) if previous > 0 else 0.0)
        previous = p
    return conditional


def measured_prior(per_position: Sequence[float] | None, floor: float = 0.05,
                   ceiling: float = 0.95) -> list[float] | None:
    """The :class:`AcceptanceEstimate` prior of a drafter whose acceptance per position was
    measured (``per_position`` as vLLM counts it, :func:`conditional_acceptance`), each rate
    kept within ``[floor, ceiling]``: a position measured at 0 still gets tried once the
    earlier ones accept more than they did there, and none is taken as certain. ``None``
    (nothing measured, or not a list of rates): no prior of the checkpoint's own."""
    if not per_position or not isinstance(per_position, (list, tuple)):
        return None
    try:
        rates = conditional_acceptance([float(p) for p in per_position])
    except (TypeError, ValueError):
        return None
    return [min(max(a, floor), ceiling) for a in rates]


def checkpoint_prior(hf_config) -> list[float] | None:
    """:func:`measured_prior` of the acceptance per position a checkpoint's config.json
    records (:data:`CHECKPOINT_ACCEPTANCE_KEY`; ``hf_config``: the engine's config object,
    or a dict), else ``None``."""
    if isinstance(hf_config, Mapping):
        return measured_prior(hf_config.get(CHECKPOINT_ACCEPTANCE_KEY))
    return measured_prior(getattr(hf_config, CHECKPOINT_ACCEPTANCE_KEY, None))


@dataclass
class AcceptanceEstimate:
    """Running estimate of the conditional acceptance of each draft position, from verify
    outcomes (``(drafts proposed, drafts accepted)`` per request and step, which both
    engines report). Each position keeps exponentially weighted counts of trials (the
    position was verified: every earlier draft was accepted) and successes, starting from a
    prior of ``prior_weight`` pseudo-trials at ``prior``: one rate for every position
    (optimistic by default, so a fresh server drafts and measures), or one per position
    (:func:`measured_prior`: what the checkpoint's drafts were measured to accept; the
    positions past the list take its last rate)."""

    max_drafts: int
    prior: float | Sequence[float] = 0.8
    prior_weight: float = 4.0
    decay: float = 0.999  # per update; ~1000 verify outcomes of memory
    trials: list[float] = field(init=False)
    successes: list[float] = field(init=False)

    def __post_init__(self) -> None:
        rates = [self.prior] if isinstance(self.prior, (int, float)) else list(self.prior)
        if (not rates or not all(0.0 <= r <= 1.0 for r in rates) or self.prior_weight <= 0
                or not 0 < self.decay <= 1):
            raise ValueError("prior in [0, 1] (one rate, or one per position), prior_weight "
                             "> 0 and decay in (0, 1] needed")
        rates = [float(rates[min(i, len(rates) - 1)]) for i in range(self.max_drafts)]
        self.trials = [self.prior_weight] * self.max_drafts
        self.successes = [r * self.prior_weight for r in rates]

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """One verify outcome: ``num_accepted`` of ``num_drafts`` drafts passed."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        verified = min(num_drafts, num_accepted + 1, self.max_drafts)
        for i in range(self.max_drafts):
            self.trials[i] *= self.decay
            self.successes[i] *= self.decay
        for i in range(verified):
            self.trials[i] += 1.0
            self.successes[i] += 1.0 if i < num_accepted else 0.0

    @property
    def conditional(self) -> list[float]:
        """``a(i)``, ``i = 1 .. max_drafts``: P(draft i accepted | drafts before it were)."""
        return [s / t for s, t in zip(self.successes, self.trials)]
