"""NLD linear self-speculation: a bidirectional draft pass (LoRA on), a causal verify pass.

One set of weights does both passes (:mod:`diffspec.model_executors.reference.nld`). The step is the
reference decoder's (:func:`diffspec.spec_workers.reference.decoder.speculative_generate`); the draft is:

1. the block ``[anchor, <mask> x n]`` runs at positions ``cache_len .. cache_len + n``,
   bidirectional over the prefix KV cache and the block, with the draft LoRA enabled and
   no KV written (:meth:`NLDModel.draft_logits`);
2. the logits are unshifted (block position ``j`` predicts its own token: the drafts are
   block positions ``1 .. n``), or shifted for ``dlm_type == "dream"`` checkpoints;
3. :func:`~diffspec.spec_workers.reference.decoder.sample_drafts` turns them into draft tokens.

The verify pass is the plain causal model (LoRA off) over ``[anchor, d_1 .. d_n]``.

Accept rules (``accept_rule``):

* ``"lossless"`` (default): greedy drafts are argmaxes; seeded sampled drafts use the
  verifier's coupled noise (most acceptance, output exactly seeded AR); unseeded drafts are
  ``d ~ q`` and ``q`` is returned, so rejection sampling accepts with ``min(1, p/q)``.
* ``"sample_and_match"``: NLD's own T > 0 rule: draw ``d ~ q`` independently, accept while
  the AR *sample* at that position equals the draft, and emit the AR sample at the first
  mismatch. That is coupled acceptance with point-mass drafts (for a seeded request the AR
  sample is ``argmax(logits + noise)``) and, in distribution, rejection sampling with
  point-mass drafts (accept with probability ``p(d)``, else draw from ``p`` without ``d``).
  So it is lossless as well; it just accepts less than ``min(1, p/q)`` does when ``q`` is
  informative.
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
