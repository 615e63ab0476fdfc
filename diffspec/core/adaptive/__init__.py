"""Adaptive draft length: how many tokens each request drafts this step, given the load.
One module per idea: :mod:`.profile` (the latency profile, a method's step cost),
:mod:`.acceptance` (expected tokens, priors, the running estimate), :mod:`.search` (the
draft-count search), :mod:`.calibration` (the step-time fit, the rate guard),
:mod:`.hybrid` (draft sources, seeded requests) and :mod:`.policy` (the per-server state).

Design notes: docs/design/core.md (section ``diffspec/core/adaptive/``).
"""

from diffspec.core.adaptive.acceptance import (
    CHECKPOINT_ACCEPTANCE_KEY,
    AcceptanceEstimate,
    checkpoint_prior,
    conditional_acceptance,
    expected_tokens,
    measured_prior,
)
from diffspec.core.adaptive.calibration import RateGuard, StepTimeFit
from diffspec.core.adaptive.hybrid import SOURCES, seeded_draft_count
from diffspec.core.adaptive.policy import AdaptiveDrafts
from diffspec.core.adaptive.profile import LatencyProfile, StepCost, load_latency_profile
from diffspec.core.adaptive.search import (
    choose_draft_counts,
    choose_shared_draft_count,
    choose_shared_draft_counts,
    tokens_per_second,
)

__all__ = [
    "CHECKPOINT_ACCEPTANCE_KEY",
    "SOURCES",
    "AcceptanceEstimate",
    "AdaptiveDrafts",
    "LatencyProfile",
    "RateGuard",
    "StepCost",
    "StepTimeFit",
    "checkpoint_prior",
    "choose_draft_counts",
    "choose_shared_draft_count",
    "choose_shared_draft_counts",
    "conditional_acceptance",
    "expected_tokens",
    "load_latency_profile",
    "measured_prior",
    "seeded_draft_count",
    "tokens_per_second",
]
