"""ReFusion: slot-level plan-and-infill decoding with one causal model (reference decoder).

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/refusion.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffspec.core.kv import rollback_kv
from diffspec.core.slots import (
    committed_slot_lengths,
    first_stop_in_slots,
    score_slots,
    select_slots,
    verify_slot_drafts,
)
from diffspec.methods import get_method
from diffspec.spec_workers.reference.decoder import Request, RequestOutput

_DEFAULTS = get_method("refusion").defaults  # the one source of the defaults

__all__ = ["ReFusionConfig", "ReFusionOutput", "decoder", "refusion_generate"]


@dataclass(frozen=True)
class ReFusionConfig:
    """Decoding knobs of ReFusion (defaults: the registry's, :mod:`diffspec.methods`)."""

    slot_size: int = _DEFAULTS["slot_size"]  # trained on 4 / 8 / 16 / 32
    num_blocks: int = _DEFAULTS["num_blocks"]  # serial blocks (generate.py's serial_num_blocks)
    slot_threshold: float = _DEFAULTS["slot_threshold"]  # plan: slots whose first-token prob > this
    token_threshold: float = _DEFAULTS["token_threshold"]  # infill: drafts whose causal prob > this

    def __post_init__(self) -> None:
        for name in ("slot_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0.0 <= value <= 1.0  # also rejects NaN
            ):
                raise ValueError(
                    f"{name} must be a probability in [0, 1] (compared strictly: 1 never "
                    f"passes, 0 always does), got {value!r}"
                )

    def layout(self, max_tokens: int) -> tuple[int, int]:
        """``(gen_len, block_len)``: ``max_tokens`` rounded up to whole slots, split into
        ``num_blocks`` blocks of whole slots; raises ``ValueError`` if it does not split."""
        gen_len = math.ceil(max_tokens / self.slot_size) * self.slot_size
        block_len = gen_len // self.num_blocks
        if gen_len % self.num_blocks or block_len % self.slot_size:
            raise ValueError(
                f"ReFusion cannot split max_tokens={max_tokens} (rounded up to "
                f"{gen_len // self.slot_size} slots of {self.slot_size} = {gen_len} tokens) into "
                f"{self.num_blocks} serial blocks of whole slots: slot_size must divide the block "
                f"length gen_len / num_blocks; use max_tokens a multiple of "
                f"{self.slot_size * self.num_blocks} or change slot_size / num_blocks"
            )
        return gen_len, block_len


@dataclass
class ReFusionOutput(RequestOutput):
    """:class:`RequestOutput` plus the plan trace. ``accept_lengths`` holds the tokens
    committed per round; draft counts are the drafts judged by the token threshold."""

    slots_per_plan: list[int] = field(default_factory=list)  # [num_rounds] slots chosen
    slot_rounds: list[int] = field(default_factory=list)  # [num_slots] round committed, -1 never
    cache_position_ids: list[int] = field(default_factory=list)  # [cache_len] in cache order


@dataclass
class _Run:
    """One request in flight: the cache holds every committed token, in commit order."""

    cache: object  # DynamicCache, batch 1 between rounds
    position_ids: list[int]  # [cache_len] true position of each cache entry
    slot_tokens: dict[int, list[int]]  # committed slot -> its tokens (cut after a stop)
    masked: list[int]  # still-masked slots of the current block, in original order
    first_position: int  # position of slot 0's first token (= prompt length)
    device: torch.device
    stopped: bool
    output: ReFusionOutput


def refusion_generate(
    model, requests: list[Request], config: ReFusionConfig, mask_token_id: int
) -> list[ReFusionOutput]:
    """Decode each request with ReFusion's plan-and-infill rounds (greedy)."""
    vocab = model.config.vocab_size
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary [0, {vocab})")
    return [_generate_one(model, request, config, mask_token_id) for request in requests]


# ------------------------------------------------------------------------------ the loop


@torch.inference_mode()
def _generate_one(model, request: Request, cfg: ReFusionConfig, mask_id: int) -> ReFusionOutput:
    from transformers import DynamicCache

    if not request.sampling.is_greedy:
        raise ValueError("the ReFusion reference decoder is greedy only (temperature 0)")
    if request.stop_strings:
        raise ValueError("the ReFusion reference decoder supports stop_token_ids, not stop_strings")
    gen_len, block_len = cfg.layout(request.max_tokens)
    prompt = request.prompt_token_ids
    request.check_fits(model.config.max_position_embeddings, model.config.vocab_size)
    if len(prompt) + gen_len > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + {gen_len} generated positions (max_tokens rounded "
            f"up to whole slots) exceeds max_position_embeddings "
            f"({model.config.max_position_embeddings})"
        )
    cache = DynamicCache(config=model.config)
    device = model.device
    prompt_ids = torch.tensor([prompt], device=device)  # [1, prompt_len]
    _forward(model, cache, prompt_ids, torch.arange(len(prompt), device=device)[None])  # prefill
    output = ReFusionOutput(slot_rounds=[-1] * (gen_len // cfg.slot_size))
    run = _Run(cache, list(range(len(prompt))), {}, [], len(prompt), device, False, output)

    slots_per_block = block_len // cfg.slot_size
    for block in range(cfg.num_blocks):
        run.masked = list(range(block * slots_per_block, (block + 1) * slots_per_block))
        while run.masked:
            _round(model, run, cfg, mask_id, request.stop_token_ids)
        if run.stopped:
            break
    return _finish(run, request)


def _round(model, run: _Run, cfg: ReFusionConfig, mask_id: int, stop_ids: tuple[int, ...]) -> None:
    """One plan-and-infill round: commits at least one slot (or a slot cut at a stop)."""
    S, out, prefix_len = cfg.slot_size, run.output, len(run.position_ids)

    # plan: one forward over the still-masked slots of the block, on top of the cache
    masked = torch.tensor(run.masked, device=run.device)  # [m]
    positions = _slot_positions(run, masked, S)  # [m, S]
    logits = _forward(model, run.cache, torch.full_like(positions, mask_id).view(1, -1),
                      positions.view(1, -1), out).view(len(masked), S, -1)  # [m, S, vocab]
    rollback_kv(run.cache, prefix_len)
    scores, _ = score_slots(logits[:, 0])  # [m]
    chosen = select_slots(scores, cfg.slot_threshold).nonzero().flatten()  # ascending
    slots, positions = masked[chosen], positions[chosen]  # [k], [k, S]
    drafts = logits[chosen].argmax(dim=-1)  # [k, S]
    out.slots_per_plan.append(len(slots))

    # global verify: the chosen drafts one after the other, causally, writing their KV
    logits = _forward(model, run.cache, drafts.view(1, -1), positions.view(1, -1), out)
    accepted = _verify(drafts, logits.view(len(slots), S, -1), 0, cfg.token_threshold, out)
    stop_at = first_stop_in_slots(drafts, accepted, stop_ids)  # [k], -1 = none
    keep, stopped = committed_slot_lengths(accepted, stop_at, S)  # leading complete slots
    if keep:
        lead = len(keep)
        rollback_kv(run.cache, prefix_len + sum(keep))  # this pass's KV, in commit order
        _commit(run, slots[:lead], drafts[:lead], keep, stopped=stopped)
        return
    rollback_kv(run.cache, prefix_len)

    # parallel completion: one batch row per chosen slot, each over the prefix KV only
    tokens, rows, stopped = drafts.clone(), len(slots), False
    keep = [S] * rows
    if rows > 1:
        run.cache.batch_repeat_interleave(rows)
    start = 0  # window start: positions before it are final, and in every row's cache
    while int(accepted.min()) < S:
        open_ = torch.arange(S, device=run.device)[None] >= accepted[:, None]  # [rows, S] to fill
        window = slice(start, S)
        draft_in = torch.where(open_, mask_id, tokens)[:, window]
        proposed = _forward(model, run.cache, draft_in, positions[:, window], out).argmax(-1)
        rollback_kv(run.cache, prefix_len + start)
        tokens[:, window] = torch.where(open_[:, window], proposed, tokens[:, window])
        logits = _forward(model, run.cache, tokens[:, window], positions[:, window], out)
        accepted = _verify(tokens, logits, start, cfg.token_threshold, out, accepted)
        stop_at = first_stop_in_slots(tokens, accepted, stop_ids)
        if bool((stop_at >= 0).any()):  # rows after the first stop are dropped
            stopped, rows = True, int((stop_at >= 0).nonzero()[0]) + 1
            tokens, positions, accepted = tokens[:rows], positions[:rows], accepted[:rows]
            keep = [S] * (rows - 1) + [int(stop_at[rows - 1]) + 1]
            accepted[-1] = S
            run.cache.batch_select_indices(torch.arange(rows, device=run.device))
            slots = slots[:rows]
        start = int(accepted.min())  # first open position of the slowest row (S: all done)
        rollback_kv(run.cache, prefix_len + start)
    _merge_rows(run.cache, prefix_len, keep)
    _commit(run, slots, tokens, keep, stopped)


def _verify(
    tokens: Tensor,  # [rows, S] drafts, the window [start:] fed to the verify pass
    logits: Tensor,  # [rows, S - start, vocab] verify logits of the window
    start: int,
    threshold: float,
    out: ReFusionOutput,
    accepted: Tensor | None = None,  # [rows] accepted before this pass; None = 0
) -> Tensor:  # [rows]
    """Accept by the token threshold; count the drafts it judged and passed."""
    # [rows, S]; entries at positions <= accepted are ignored by the rule
    probs = torch.ones(tokens.shape, dtype=logits.dtype, device=tokens.device)
    window = tokens[:, start + 1 :]
    probs[:, start + 1 :] = torch.softmax(logits[:, :-1], -1).gather(-1, window[..., None])[..., 0]
    before = torch.zeros_like(tokens[:, 0]) if accepted is None else accepted
    new = verify_slot_drafts(tokens, probs, threshold, before)
    judged = (tokens.shape[1] - 1 - before).clamp(min=0)  # drafts after the forced token
    out.num_draft_tokens += int(judged.sum())
    out.num_accepted_tokens += int((new - before - 1).clamp(min=0).sum())
    return new


# ------------------------------------------------------------------------- bookkeeping


def _forward(
    model, cache, input_ids: Tensor, position_ids: Tensor, count: RequestOutput | None = None
) -> Tensor:
    """One causal forward of ``input_ids`` [rows, n] at ``position_ids`` [rows, n] on top
    of ``cache`` (which it extends); returns fp32 logits [rows, n, vocab]. Counted in
    ``count.num_forwards`` (the prompt prefill passes no ``count``)."""
    if count is not None:
        count.num_forwards += 1
    out = model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                use_cache=True)
    return out.logits.float()


def _slot_positions(run: _Run, slots: Tensor, slot_size: int) -> Tensor:  # [len(slots), S]
    """True position ids of the given slots' tokens."""
    offsets = torch.arange(slot_size, device=slots.device)
    return run.first_position + slots[:, None] * slot_size + offsets[None]


def _merge_rows(cache, prefix_len: int, keep: list[int]) -> None:
    """Lay each batch row's new KV (its first ``keep[r]`` entries after the prefix) one
    after another behind the shared prefix, back to batch 1: the commit order."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # [rows, kv_heads, prefix_len + S, head_dim]
            parts = [kv[:1, :, :prefix_len]]
            parts += [kv[r : r + 1, :, prefix_len : prefix_len + k] for r, k in enumerate(keep)]
            setattr(layer, name, torch.cat(parts, dim=2))


def _commit(run: _Run, slots: Tensor, tokens: Tensor, keep: list[int], stopped: bool) -> None:
    """Record committed slots (their KV is already in the cache, in this order)."""
    S = tokens.shape[1]
    round_ = len(run.output.slots_per_plan) - 1
    for slot, row, k in zip(slots.tolist(), tokens.tolist(), keep):
        run.slot_tokens[slot] = row[:k]
        run.output.slot_rounds[slot] = round_
        run.position_ids += [run.first_position + slot * S + j for j in range(k)]
        run.masked.remove(slot)
    run.output.accept_lengths.append(sum(keep))
    if stopped:  # nothing after the stop slot will be generated
        run.stopped = True
        last = int(slots[-1])
        run.masked = [s for s in run.masked if s < last]


def _finish(run: _Run, request: Request) -> ReFusionOutput:
    """Read the slots back in original order, cut after the first stop and at max_tokens."""
    out = run.output
    tokens: list[int] = []
    for slot in range(len(out.slot_rounds)):
        if slot not in run.slot_tokens:
            break  # only slots after a stop are never generated
        tokens += run.slot_tokens[slot]
    for i, t in enumerate(tokens):
        if t in request.stop_token_ids:
            tokens = tokens[: i + 1]
            break
    out.token_ids = tokens[: request.max_tokens]
    stopped = bool(out.token_ids) and out.token_ids[-1] in request.stop_token_ids
    out.finish_reason = "stop" if stopped else "length"
    out.cache_position_ids = list(run.position_ids)
    return out


def decoder(info, options):
    """The reference decoder of method ``refusion`` (registry factory): slot size, serial
    blocks and thresholds as :class:`ReFusionConfig` takes them."""
    from diffspec.model_executors.reference.refusion import load_refusion
    from diffspec.spec_workers.reference.decoder import causal_decoder

    model, info = load_refusion(info.path, dtype=options.get("dtype", torch.float32))
    config = ReFusionConfig(**{k: options[k] for k in ("slot_size", "num_blocks",
                                                       "slot_threshold", "token_threshold")})
    mask_id = int(info.mask_token_id)
    return causal_decoder(
        "refusion", info, model,
        lambda requests, tok: refusion_generate(model, requests, config, mask_id), options)
