"""ReFusion: slot-level plan-and-infill decoding with one causal model (reference decoder).

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/refusion.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from diffspec.core.kv import rollback_kv
from diffspec.core.refusion import LogitsForwards, SlotRule, SlotRun, refusion_decode, slot_output
from diffspec.core.slots import slot_layout
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
        gen_len, block_len = slot_layout(max_tokens, self.slot_size, self.num_blocks)
        if block_len is None:
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


@dataclass(kw_only=True)
class _Run(SlotRun):
    """One request in flight: the cache holds every committed token, in commit order."""

    cache: object  # DynamicCache, batch 1 between rounds
    position_ids: list[int]  # [cache_len] true position of each cache entry
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
    gen_len, _ = cfg.layout(request.max_tokens)
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
    run = _Run(cache=cache, position_ids=list(range(len(prompt))), output=output,
               prompt_len=len(prompt), device=device)
    rule = SlotRule(cfg.slot_size, cfg.num_blocks, cfg.slot_threshold, cfg.token_threshold,
                    mask_id)
    decoding = refusion_decode(run, rule, _Forwards(run, cfg.slot_size), request.max_tokens,
                               request.stop_token_ids)
    logits = None
    while True:  # every forward the rounds ask for, one after another
        try:
            input_ids, position_ids = decoding.send(logits)
        except StopIteration:
            break
        logits = _forward(model, cache, input_ids, position_ids, output)
    return _finish(run, request)


class _Forwards(LogitsForwards):
    """The forwards of :func:`refusion_generate` on its ``DynamicCache``: each yields
    ``(input_ids, position_ids)`` [rows, n] and is sent their fp32 logits, after rolling
    the cache back to the committed entries and each row's first ``start``."""

    def __init__(self, run: _Run, slot_size: int) -> None:
        self.run, self.slot_size = run, slot_size

    def forward(self, input_ids: Tensor, positions: Tensor, start: int):
        rollback_kv(self.run.cache, self.run.kv_len + start)
        return (yield input_ids, positions)

    def verify(self, input_ids: Tensor, positions: Tensor):
        self.run.output.slots_per_plan.append(len(input_ids))  # the slots the plan chose
        return (yield from super().verify(input_ids, positions))

    def open_rows(self, rows: int):
        """Each row over a copy of the committed KV (the batch dimension)."""
        rollback_kv(self.run.cache, self.run.kv_len)
        if rows > 1:
            self.run.cache.batch_repeat_interleave(rows)
        yield from ()

    def keep_rows(self, rows: int) -> None:
        self.run.cache.batch_select_indices(torch.arange(rows, device=self.run.device))

    def verified(self, before: Tensor | None, accepted: Tensor) -> None:
        """Count the drafts the token threshold judged and passed."""
        out, S = self.run.output, self.slot_size
        before = torch.zeros_like(accepted) if before is None else before
        judged = (S - 1 - before).clamp(min=0)  # drafts after the forced token
        out.num_draft_tokens += int(judged.sum())
        out.num_accepted_tokens += int((accepted - before - 1).clamp(min=0).sum())

    def commit(self, slots: Tensor, keep: list[int], parallel: bool) -> None:
        """Keep the committed KV (the rows' laid one after another), trace the round."""
        run, S = self.run, self.slot_size
        if parallel:
            _merge_rows(run.cache, run.kv_len, keep)
        else:
            rollback_kv(run.cache, run.kv_len + sum(keep))
        round_ = len(run.output.slots_per_plan) - 1
        for slot, k in zip(slots.tolist(), keep):
            run.output.slot_rounds[slot] = round_
            run.position_ids += [run.prompt_len + slot * S + j for j in range(k)]
        run.output.accept_lengths.append(sum(keep))


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


def _merge_rows(cache, prefix_len: int, keep: list[int]) -> None:
    """Lay each batch row's new KV (its first ``keep[r]`` entries after the prefix) one
    after another behind the shared prefix, back to batch 1: the commit order."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # [rows, kv_heads, prefix_len + S, head_dim]
            parts = [kv[:1, :, :prefix_len]]
            parts += [kv[r : r + 1, :, prefix_len : prefix_len + k] for r, k in enumerate(keep)]
            setattr(layer, name, torch.cat(parts, dim=2))


def _finish(run: _Run, request: Request) -> ReFusionOutput:
    """Read the slots back in original order, cut after the first stop and at max_tokens."""
    out = run.output
    out.token_ids = slot_output(run, request.stop_token_ids, request.max_tokens)
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
