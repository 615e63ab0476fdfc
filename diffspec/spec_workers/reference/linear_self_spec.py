"""NLD linear self-speculation: a bidirectional draft pass (LoRA on), a causal verify pass.

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/linear_self_spec.py``).
"""

from __future__ import annotations

from typing import Literal

from diffspec.model_executors.reference.nld import NLDModel
from diffspec.spec_workers.reference.decoder import BlockDrafter

__all__ = ["LinearSelfSpecDrafter"]

AcceptRule = Literal["lossless", "sample_and_match"]


class LinearSelfSpecDrafter(BlockDrafter):
    """Drafts with the bidirectional (LoRA) pass of an :class:`NLDModel` (one forward)."""

    model: NLDModel

    def __init__(self, model: NLDModel, accept_rule: AcceptRule = "lossless") -> None:
        if accept_rule not in ("lossless", "sample_and_match"):
            raise ValueError(f"accept_rule must be 'lossless' or 'sample_and_match', "
                             f"got {accept_rule!r}")
        super().__init__(model)
        self.accept_rule = accept_rule
        self.point_mass = accept_rule == "sample_and_match"


def decoder(info, options):
    """The reference decoder of method ``linear_self_spec`` (registry factory): the NLD
    LoRA draft pass, AR verify; ``num_draft_tokens`` per step (default: the block)."""
    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.spec_workers.reference.decoder import speculative_decoder

    def load(dtype):
        model = load_nld(info.path, dtype=dtype)
        return model, LinearSelfSpecDrafter(model)

    return speculative_decoder("linear_self_spec", info, options, load)
