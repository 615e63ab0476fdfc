"""Orthrus drafting: one diffusion-view forward drafts up to ``block_size - 1`` tokens.

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/orthrus.py``).
"""

from __future__ import annotations

from diffspec.spec_workers.reference.decoder import BlockDrafter

__all__ = ["decoder"]


def decoder(info, options):
    """The reference decoder of method ``orthrus`` (registry factory): the diffusion view
    drafts, the AR view verifies; ``num_draft_tokens`` per step (default: the block)."""
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import speculative_decoder

    def load(dtype):
        model = load_orthrus(info.path, dtype=dtype)
        return model, BlockDrafter(model)

    return speculative_decoder("orthrus", info, options, load)
