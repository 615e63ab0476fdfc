"""TiDAR and NLD quadratic self-speculation: draft and verify in one forward per step.

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/tidar.py``).
"""

from __future__ import annotations

import torch

from diffspec.core.masks import quadratic_branch_indices
from diffspec.model_executors.reference.tidar import QuadraticModel, commit_kv, quadratic_forward
from diffspec.spec_workers.reference.decoder import (
    AcceptMode,
    Request,
    RequestOutput,
    accept_drafts,
    accept_mode,
    commit_tokens,
    sample_drafts,
    start_request,
)

__all__ = ["tidar_generate"]


def tidar_generate(
    model: QuadraticModel,
    requests: list[Request],
    num_draft_tokens: int | None = None,
    accept: AcceptMode = "auto",
    tokenizer=None,
) -> list[RequestOutput]:
    """Quadratic self-speculative decoding, one request at a time (lockstep per request).

    ``num_draft_tokens`` (default :attr:`QuadraticModel.max_draft_tokens`) caps the drafts
    per step; the branches then hold just enough masks. ``accept`` is the reference
    decoder's: ``"auto"`` is greedy / coupled (seeded) / rejection (unseeded), and
    ``"rejection"`` forces rejection sampling with draft probabilities ``q``.
    """
    limit = model.max_draft_tokens
    max_drafts = limit if num_draft_tokens is None else num_draft_tokens
    if not 0 <= max_drafts <= limit:
        raise ValueError(f"num_draft_tokens={num_draft_tokens}: this checkpoint drafts 0 .. "
                         f"{limit} tokens per step (block_size={model.block_size}, "
                         f"logits_shift={model.logits_shift})")
    return [_generate_one(model, r, max_drafts, accept, tokenizer) for r in requests]


def _generate_one(model: QuadraticModel, request: Request, max_drafts: int, accept: AcceptMode,
                  tokenizer) -> RequestOutput:
    mode, params = accept_mode(request, accept), request.sampling
    generator = None
    if mode == "rejection" and params.seed is not None:
        generator = torch.Generator(device=model.lm.device).manual_seed(params.seed)
    max_len = model.config.max_position_embeddings
    skip = 0 if model.logits_shift else 1  # unshifted: the first mask sits on the bonus token
    run = start_request(model.lm, request)  # prefill all but the anchor (not counted)
    drafts, draft_probs = [], None  # bootstrap: the first step verifies the anchor alone
    while True:
        prefix_len, n = run.cache.get_seq_length(), len(drafts)

        # draft + verify: one forward; the branch shrinks near the context limit
        num_masks = max(1, min(max_drafts + skip, max_len - 1 - (prefix_len + n)))
        logits = quadratic_forward(model, run.cache, run.token_ids[-1], drafts, num_masks)
        run.output.num_forwards += 1

        # accept: the verify rows are the AR logits of [anchor, d_1 .. d_n]
        result = accept_drafts(mode, params, drafts, draft_probs, logits[: n + 1], prefix_len + 1,
                         generator)
        accepted = int(result.num_accepted[0])
        run.output.num_draft_tokens += n
        run.output.num_accepted_tokens += accepted

        # commit: emitted tokens (cut at a stop or max_tokens); KV of t_0 .. t_a only
        commit_tokens(run, result.tokens(0), tokenizer)
        commit_kv(run.cache, prefix_len, accepted)
        if run.output.finish_reason is not None:
            return run.output

        # next drafts: branch `accepted` pre-drafted exactly this outcome
        branch = logits[quadratic_branch_indices(accepted, n, num_masks)]  # [K', vocab]
        count = min(max_drafts, run.remaining - 1)
        drafts, draft_probs = sample_drafts(branch[skip:][:count], params, len(run.token_ids),
                                            generator)


def decoder(info, options):
    """The reference decoder of method ``tidar`` (registry factory): a TiDAR or NLD
    checkpoint in quadratic mode, ``num_draft_tokens`` drafts per step (default: one
    trained branch)."""
    from diffspec.core.checkpoint import CheckpointError, require_method
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.spec_workers.reference.decoder import causal_decoder

    require_method(info, "tidar")
    model = load_quadratic(info.path, dtype=options.get("dtype", torch.float32))
    k = options.get("num_draft_tokens") or model.max_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {k!r}")
    if k > model.max_draft_tokens:
        raise CheckpointError(f"checkpoint {info.path} drafts at most {model.max_draft_tokens} "
                              f"tokens per step (block_size={model.block_size}); {k} requested")
    return causal_decoder(
        "tidar", info, model.lm,
        lambda requests, tok: tidar_generate(model, requests, k, tokenizer=tok),
        {**options, "num_draft_tokens": k}, model.eos_token_ids)
