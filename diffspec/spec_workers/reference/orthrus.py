"""Orthrus drafting: one diffusion-view forward drafts up to ``block_size - 1`` tokens.

The step (draft -> verify -> accept -> commit) is the reference decoder's
(:func:`diffspec.spec_workers.reference.decoder.speculative_generate`); the draft is:

1. the block ``[anchor, <mask> x n]`` runs at positions ``cache_len .. cache_len + n`` in
   the diffusion view (every layer's attention uses its ``*_diff`` projections and norms),
   non-causal over the request's AR KV cache and the block; the block's K/V are not kept
   (:meth:`OrthrusModel.draft_logits`);
2. the logits are shifted: block position ``j`` predicts token ``j + 1``, so ``n`` drafts;
3. :func:`~diffspec.spec_workers.reference.decoder.sample_drafts` turns them into draft tokens under the
   request's sampling (argmax; the verifier's coupled noise for seeded requests; ``d ~ q``
   returned with ``q`` for rejection sampling).

Verification is one causal AR forward over ``[anchor, d_1 .. d_n]`` (greedy, coupled or
rejection acceptance), so the output is the AR model's token for token (greedy, seeded) or
in distribution (unseeded). A draft + verify cycle counts two forwards.

Usage::

    model = load_orthrus("/path/to/Orthrus-Qwen3-8B")
    outputs = speculative_generate(model.lm, BlockDrafter(model), requests,
                                   num_draft_tokens=model.block_size - 1)
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
