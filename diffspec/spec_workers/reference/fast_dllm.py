"""Fast-dLLM: block-wise diffusion decoding with a KV cache and confidence-threshold
parallel unmasking, for LLaDA, Dream, Fast-dLLM v2 and NLD's diffusion mode
(:mod:`diffspec.model_executors.reference.dllm`).

Design notes: docs/design/reference.md (section ``diffspec/spec_workers/reference/fast_dllm.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor

from diffspec.core.checkpoint import CheckpointError, CheckpointInfo, validate_block_size
from diffspec.core.kv import restore_rows, rollback_kv, save_rows
from diffspec.core.masks import block_causal_mask, block_diffusion_mask
from diffspec.core.unmask import confidence_unmask, shift_logits
from diffspec.methods import get_method
from diffspec.model_executors.reference.dllm import DiffusionLM
from diffspec.spec_workers.reference.decoder import Request, RequestOutput

__all__ = ["CACHE_MODES", "Canvas", "FastDLLMConfig", "FastDLLMOutput", "KVState",
           "decode_block", "fast_dllm_generate", "turn_end_token_ids"]

CacheMode = Literal["none", "prefix", "dual"]
CACHE_MODES: tuple[CacheMode, ...] = ("none", "prefix", "dual")
V2_SUB_BLOCK = 8  # Fast-dLLM v2's small_block_size


@dataclass(frozen=True)
class FastDLLMConfig:
    """One Fast-dLLM decoding configuration, validated here."""

    cache: CacheMode = "prefix"
    # commit every masked slot with confidence > threshold (+ the top-1); default: the registry
    threshold: float = get_method("fast_dllm").defaults["threshold"]
    block_size: int | None = None  # None: the checkpoint's bd_size (Fast-dLLM v2), else 32
    sub_block_size: int | None = None  # None: 8 for Fast-dLLM v2 (if it divides), else block
    gen_length: int | None = None  # LLaDA/Dream: mask slots after the prompt (None: max_tokens);
    # block-causal families ignore it (later blocks are invisible)
    # "trained": the family's own layout (module docstring); "block_causal": every family as
    # Fast-dLLM v2, blocks from position 0 with the prompt in them, each seeing the blocks
    # before it and itself (the KV layout of SGLang's dLLM scheduler)
    attention: Literal["trained", "block_causal"] = "trained"

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {self.threshold}")
        for name in ("block_size", "sub_block_size", "gen_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.attention not in ("trained", "block_causal"):
            raise ValueError(f"attention must be 'trained' or 'block_causal', got "
                             f"{self.attention!r}")
        if self.block_size and self.sub_block_size and self.block_size % self.sub_block_size:
            raise ValueError(f"sub_block_size {self.sub_block_size} must divide "
                             f"block_size {self.block_size}")

    @classmethod
    def reference(cls, **sizes: Any) -> FastDLLMConfig:
        """The ground truth: no cache, one token per step (``block_size`` etc. as given)."""
        return cls(cache="none", threshold=1.0, **sizes)

    def sizes(self, info: CheckpointInfo) -> tuple[int, int]:
        """``(block_size, sub_block_size)`` for the checkpoint ``info``, defaults resolved
        and checked."""
        trained = info.block_size if info.family in ("fast_dllm_v2", "nld") else None
        block = self.block_size or trained or 32
        if info.family == "nld":  # diffusion mode: a block is block_size masks, no anchor
            if block > trained:  # type: ignore[operator]
                raise CheckpointError(f"checkpoint {info.path} was trained with block size "
                                      f"{trained}; a block of {block} slots is larger")
        else:
            validate_block_size(info, block)
        sub = self.sub_block_size
        if sub is None:
            v2 = info.family == "fast_dllm_v2" and block % V2_SUB_BLOCK == 0
            sub = V2_SUB_BLOCK if v2 else block
        if block % sub:
            raise ValueError(f"sub_block_size {sub} must divide block_size {block}")
        return block, sub


@dataclass
class FastDLLMOutput(RequestOutput):
    """A request's output; ``accept_lengths`` holds the tokens committed by each step."""

    steps_per_block: list[int] = field(default_factory=list)  # forwards per decoded block
    window_forwards: int = 0  # dual cache: steps that ran only the window over cached KV

    @property
    def mean_steps_per_block(self) -> float:
        return sum(self.steps_per_block) / max(1, len(self.steps_per_block))


@dataclass
class Canvas:
    """The batch's canvas, every request in one index space (see the module docstring),
    and its bookkeeping."""

    tokens: Tensor  # [batch, T] int64: padding, prompt, generation slots (mask until committed)
    positions: Tensor  # [batch, T] int64: position id of each slot (index - left padding)
    valid: Tensor  # [batch, T] bool: the slot belongs to the request (not padding)
    gen_start: Tensor  # [batch] int64: index of the first generated slot
    limit: Tensor  # [batch] int64: gen_start + max_tokens; slots from here are never decoded
    first_block: int  # index where the first decoded block starts
    causal_len: int  # block-causal forwards from index 0: slots before this are causal (NLD)
    mask_id: int
    done: Tensor  # [batch] bool
    stop_ids: list[Tensor]  # [batch] of [num_stop_ids]
    outputs: list[FastDLLMOutput]


@dataclass
class KVState:
    """The KV cache of a batch and which of its key slots are real tokens."""

    cache: Any | None  # DynamicCache; None for cache="none"
    valid: Tensor  # [batch, cache_len] bool, in cache order
    base_len: int = 0  # slots kept across blocks (block-causal: prompt and completed blocks)
    window: tuple[int, int] | None = None  # the window the rest of the cache was refreshed for
    read_cache: Tensor | None = None  # [batch] rows whose last step ran only the window


def fast_dllm_generate(
    lm: DiffusionLM,
    requests: Sequence[Request],
    config: FastDLLMConfig = FastDLLMConfig(),
) -> list[FastDLLMOutput]:
    """Decode a batch of requests (greedy) with Fast-dLLM; outputs in request order."""
    block, sub = config.sizes(lm.info)
    if config.attention == "block_causal":
        lm = replace(lm, attention="block_causal", causal_prefix=False)
    batch = _layout(lm, requests, config, block)
    kv = KVState(lm.new_cache() if config.cache != "none" else None,
                 torch.zeros(len(requests), 0, dtype=torch.bool))
    if lm.attention == "block_causal" and batch.first_block > 0:
        _prefill(lm, batch, kv, block)
    start = batch.first_block
    while not bool(batch.done.all()):
        decode_block(lm, batch, kv, start, block, sub, config)
        start += block
    return batch.outputs


def decode_block(
    lm: DiffusionLM, batch: Canvas, kv: KVState, start: int, block: int, sub: int,
    config: FastDLLMConfig,
) -> None:
    """Decode the block ``[start, start + block)`` of every unfinished request, step by step,
    then (block-causal) complete it: write its KV and seed the next block."""
    end = min(start + block, batch.tokens.shape[1])  # LLaDA / Dream: the last may be short
    mask_id = lm.mask_token_id
    _rollback(kv, kv.base_len)
    kv.window = None
    steps = torch.zeros(len(batch.outputs), dtype=torch.long)
    while True:
        work = _work(batch, start, end)  # [batch, end - start] masked slots still to decode
        if not bool(work.any()):
            break
        # the sub-block: the first one where some request still has work (all move together)
        c0 = start + sub * int(work.any(0).nonzero()[0, 0] // sub)
        c1 = min(c0 + sub, end)
        todo = work[:, c0 - start : c1 - start]  # [batch, sub]
        rows = todo.any(-1)  # [batch] requests taking part in this step

        logits = _step_logits(lm, batch, kv, config.cache, start, end, c0, c1, rows, block)
        logits[..., mask_id] = float("-inf")  # the mask token is never a prediction
        candidates = torch.where(todo, mask_id, -1)  # only the slots to decode count as masked
        # a shifted family's block-first slot is committed alone (the top-1 of one candidate)
        seed = rows & todo[:, 0] & (lm.logits_shift and c0 == start)  # [batch]
        candidates[seed, 1:] = -1
        tokens, chosen = confidence_unmask(logits, candidates, mask_id, config.threshold)
        _commit(batch, c0, tokens, chosen, counted=rows)
        if kv.read_cache is not None:
            for r in (rows & kv.read_cache).nonzero()[:, 0].tolist():
                batch.outputs[r].window_forwards += 1
        steps += rows
        _finish(batch)

    go = ~batch.done  # requests that continue past this block
    if lm.attention == "block_causal" and bool(go.any()) and _complete(lm, batch, kv, start,
                                                                       end, go, block):
        steps += go
    for r in steps.nonzero()[:, 0].tolist():
        batch.outputs[r].steps_per_block.append(int(steps[r]))


# ---------------------------------------------------------------------------- forwards


def _step_logits(
    lm: DiffusionLM, batch: Canvas, kv: KVState, cache: CacheMode, start: int, end: int,
    c0: int, c1: int, rows: Tensor, block: int,
) -> Tensor:  # [batch, c1 - c0, vocab], entry j predicts slot c0 + j
    """One forward per the cache strategy; the aligned logits of the sub-block ``[c0, c1)``."""
    size = batch.tokens.shape[1]
    bidirectional = lm.attention == "bidirectional"
    kv.read_cache = None
    if kv.cache is None:  # cache="none": recompute everything visible
        visible = size if bidirectional else end
        return _aligned(lm, _forward(lm, batch, kv, torch.arange(visible), block), 0, c0, c1)

    vis0, vis1 = (0, size) if bidirectional else (start, end)  # else over completed blocks
    if cache == "prefix":
        w0, w1 = (start, size) if bidirectional else (start, end)
    else:  # dual
        w0, w1 = (start, end) if bidirectional else (c0, c1)
    # a shifted window whose first slot is masked needs the slot before it: refreshed
    first_masked = rows & (batch.tokens[:, w0] == lm.mask_token_id) & lm.logits_shift  # [batch]
    new_window = kv.window != (w0, w1)
    if not new_window and not bool(first_masked.any()):
        out = _forward(lm, batch, kv, torch.arange(w0, w1), block)
        kv.read_cache = rows.clone() if cache == "dual" else None
        return _aligned(lm, out, w0, c0, c1)
    # Per request, as one request alone would: only the rows that need it are refreshed
    # (Fast-dLLM v2's batch_sample refreshes the whole batch when one row needs it, so a
    # request's output would depend on its batch neighbours). The others read the cache
    # and keep their K/V.
    cached = rows & ~first_masked if not new_window else torch.zeros_like(rows)
    if bool(cached.any()):
        kept = _aligned(lm, _forward(lm, batch, kv, torch.arange(w0, w1), block), w0, c0, c1)
        saved = save_rows(kv.cache, cached)
    _rollback(kv, kv.base_len)
    idx = torch.arange(vis0, vis1)
    in_window = (idx >= w0) & (idx < w1)
    order = torch.cat([idx[~in_window], idx[in_window]])  # the window last
    out = _forward(lm, batch, kv, order, block, keep=True)
    _rollback(kv, kv.valid.shape[1] - (w1 - w0))
    kv.window = (w0, w1)
    natural = torch.empty_like(out)
    natural[:, order - vis0] = out
    logits = _aligned(lm, natural, vis0, c0, c1)
    if bool(cached.any()):
        restore_rows(kv.cache, saved, cached)
        logits = torch.where(cached[:, None, None], kept, logits)
        kv.read_cache = cached if cache == "dual" else None
    return logits


def _aligned(lm: DiffusionLM, logits: Tensor, first: int, c0: int, c1: int) -> Tensor:
    """Slots ``[c0, c1)`` of ``logits`` (``[batch, n, vocab]`` for slots ``first ..``), shifted
    for shifted families (each slot reads its predecessor's logits)."""
    if lm.logits_shift:
        logits = shift_logits(logits)
    return logits[:, c0 - first : c1 - first]


def _forward(
    lm: DiffusionLM, batch: Canvas, kv: KVState, order: Tensor, block: int, keep: bool = False,
) -> Tensor:  # [batch, n, vocab]
    """Run the slots ``order`` ([n] indices) over the cache, under the family's mask."""
    n, cache_len = order.numel(), kv.valid.shape[1]
    if lm.attention == "block_causal" and cache_len == 0 and torch.equal(order, torch.arange(n)):
        # [n, n] from index 0: prefill, cache="none"
        structure = block_causal_mask(n, block, prefix_len=min(batch.causal_len, n))
    else:  # one block (or the bidirectional canvas) over whatever the cache holds
        structure = block_diffusion_mask(cache_len, n)  # [n, cache_len + n]
    keys = torch.cat([kv.valid, batch.valid[:, order]], dim=1)  # [batch, cache_len + n]
    mask = structure & keys[:, None, :]
    mask[:, :, cache_len:] |= torch.eye(n, dtype=torch.bool)  # a padding slot sees itself
    logits = lm.forward(batch.tokens[:, order], batch.positions[:, order], mask, kv.cache,
                        keep_kv=keep)
    if keep:
        kv.valid = keys
    return logits


def _prefill(lm: DiffusionLM, batch: Canvas, kv: KVState, block: int) -> None:
    """Block-causal families: run the prompt slots before the first block (Fast-dLLM v2: the
    prompts' full blocks; NLD: the causal prompt), KV kept; a prompt that ends on the block
    boundary gets its first token, the argmax of the last logit (shifted families)."""
    if kv.cache is None and not lm.logits_shift:
        return  # nothing to keep, nothing to seed
    first = batch.first_block
    logits = _forward(lm, batch, kv, torch.arange(first), block, keep=kv.cache is not None)
    kv.base_len = kv.valid.shape[1]
    for r in batch.valid[:, first - 1].nonzero()[:, 0].tolist():
        batch.outputs[r].num_forwards += 1
    seeded = (batch.gen_start == first) & ~batch.done & lm.logits_shift
    _seed(batch, first, logits[:, -1], seeded)


def _complete(
    lm: DiffusionLM, batch: Canvas, kv: KVState, start: int, end: int, go: Tensor, block: int,
) -> bool:
    """Block-causal families: run the completed block (its KV kept) and seed slot ``end``
    (shifted families) for the requests ``go``. False when there is nothing to do (no cache
    to write, nothing to seed)."""
    if kv.cache is None and not lm.logits_shift:
        return False
    if kv.cache is None:
        logits = _forward(lm, batch, kv, torch.arange(end), block)
    else:
        _rollback(kv, kv.base_len)
        logits = _forward(lm, batch, kv, torch.arange(start, end), block, keep=True)
        kv.base_len = kv.valid.shape[1]
    _seed(batch, end, logits[:, -1], go & lm.logits_shift, counted=go)
    return True


# ---------------------------------------------------------------------------- commit


def _seed(batch: Canvas, slot: int, logits: Tensor, rows: Tensor,
          counted: Tensor | None = None) -> None:
    """Commit the argmax of ``logits`` ([batch, vocab]) at ``slot`` for ``rows``."""
    chosen = rows[:, None].clone()
    scores = logits.index_fill(-1, torch.tensor([batch.mask_id]), float("-inf"))  # never a mask
    tokens = scores.argmax(-1, keepdim=True)
    _commit(batch, slot, tokens, chosen, counted=counted)
    _finish(batch)


def _commit(batch: Canvas, c0: int, tokens: Tensor, chosen: Tensor,
            counted: Tensor | None) -> None:
    """Write ``tokens`` where ``chosen`` ([batch, n]) into slots ``c0 ..``; count the forward."""
    n = chosen.shape[1]
    view = batch.tokens[:, c0 : c0 + n]
    view.copy_(torch.where(chosen, tokens.to(view.dtype), view))
    if counted is None:
        return
    for r in counted.nonzero()[:, 0].tolist():
        batch.outputs[r].num_forwards += 1
        batch.outputs[r].accept_lengths.append(int(chosen[r].sum()))


def _finish(batch: Canvas) -> None:
    """Finish requests that committed a stop token with nothing masked before it, or all
    ``max_tokens`` slots."""
    for r in (~batch.done).nonzero()[:, 0].tolist():
        gen = batch.tokens[r, int(batch.gen_start[r]) : int(batch.limit[r])]
        masked = gen == batch.mask_id
        stops = torch.isin(gen, batch.stop_ids[r]) & ~masked
        out = batch.outputs[r]
        if bool(stops.any()):
            i = int(stops.nonzero()[0, 0])
            if not bool(masked[:i].any()):
                batch.done[r], out.finish_reason = True, "stop"
                out.token_ids = gen[: i + 1].tolist()
        elif not bool(masked.any()):
            batch.done[r], out.finish_reason = True, "length"
            out.token_ids = gen.tolist()


def _work(batch: Canvas, start: int, end: int) -> Tensor:  # [batch, end - start] bool
    idx = torch.arange(start, end)[None]
    masked = batch.tokens[:, start:end] == batch.mask_id
    return (masked & (idx >= batch.gen_start[:, None]) & (idx < batch.limit[:, None])
            & ~batch.done[:, None])


def _rollback(kv: KVState, length: int) -> None:
    """Roll the cache back to ``length`` slots by moving its length."""
    if kv.cache is not None:
        rollback_kv(kv.cache, length)
    kv.valid = kv.valid[:, :length]


# ---------------------------------------------------------------------------- layout


def _layout(lm: DiffusionLM, requests: Sequence[Request], config: FastDLLMConfig,
            block: int) -> Canvas:
    """Place every request on the shared canvas (see the module docstring)."""
    if not requests:
        raise ValueError("requests must not be empty")
    vocab = lm.info.vocab_size or lm.mask_token_id + 1
    for req in requests:
        if not req.sampling.is_greedy:
            raise ValueError("the Fast-dLLM reference decoder is greedy (temperature 0)")
        if req.stop_strings:
            raise ValueError("stop_strings are not supported by the Fast-dLLM decoder; "
                             "use stop_token_ids")
        if max(req.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids must be < vocab_size ({vocab})")
    lens = [len(r.prompt_token_ids) for r in requests]
    max_tokens = [r.max_tokens for r in requests]
    if lm.attention == "block_causal" and not lm.causal_prefix:  # blocks from position 0
        full = [length // block * block for length in lens]  # prompt slots in full blocks
        first = max(full)
        pads = [first - f for f in full]
        gen_start = [first + length % block for length in lens]
        size = first + max(math.ceil((g - first + m) / block) * block
                           for g, m in zip(gen_start, max_tokens))
        ends = [size] * len(requests)
    elif lm.attention == "block_causal":  # causal prompt, then whole blocks
        first = max(lens)
        pads = [first - length for length in lens]
        gen_start = [first] * len(requests)
        size = first + math.ceil(max(max_tokens) / block) * block
        ends = [size] * len(requests)
    else:
        first = max(lens)
        pads = [first - length for length in lens]
        gen_start = [first] * len(requests)
        gen_len = [config.gen_length or m for m in max_tokens]
        if any(g < m for g, m in zip(gen_len, max_tokens)):
            raise ValueError(f"gen_length {config.gen_length} is smaller than a request's "
                             f"max_tokens ({max(max_tokens)})")
        ends = [first + g for g in gen_len]
        size = max(ends)
    for p, e in zip(pads, ends):
        if e - p > lm.max_positions:
            raise ValueError(f"prompt + generation slots ({e - p}) exceed the model's "
                             f"{lm.max_positions} positions")

    idx = torch.arange(size)[None]
    pad, end = torch.tensor(pads)[:, None], torch.tensor(ends)[:, None]
    canvas = torch.full((len(requests), size), lm.mask_token_id, dtype=torch.long)
    canvas[idx < pad] = 0
    for r, req in enumerate(requests):
        canvas[r, pads[r] : pads[r] + lens[r]] = torch.tensor(req.prompt_token_ids)
    return Canvas(
        tokens=canvas,
        positions=(idx - pad).clamp(min=0),
        valid=(idx >= pad) & (idx < end),
        gen_start=torch.tensor(gen_start),
        limit=torch.tensor(gen_start) + torch.tensor(max_tokens),
        first_block=first,
        causal_len=first if lm.causal_prefix else 0,
        mask_id=lm.mask_token_id,
        done=torch.zeros(len(requests), dtype=torch.bool),
        stop_ids=[torch.tensor(r.stop_token_ids, dtype=torch.long) for r in requests],
        outputs=[FastDLLMOutput() for _ in requests],
    )


_ANSWER = "\x00ANSWER\x00"  # a sentinel assistant message


def turn_end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The special token the checkpoint's chat template closes an assistant turn with
    (LLaDA-8B-Instruct ``<|eot_id|>``, Dream / Fast-dLLM v2 ``<|im_end|>``), or ``()``
    without a chat template. An instruct model ends its answer there, which is not its
    config's ``eos_token_id`` for LLaDA and Dream, so a served chat must stop on it too."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANSWER}],
        tokenize=False)
    _, found, tail = text.partition(_ANSWER)
    specials = set(tokenizer.all_special_tokens) | {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    token = next((t for t in sorted(specials, key=len, reverse=True) if tail.startswith(t)), None)
    if not found or token is None:
        return ()
    return (int(tokenizer.convert_tokens_to_ids(token)),)


def decoder(info, options):
    """The reference decoder of method ``fast_dllm`` (registry factory): ``block_size``
    (default: the checkpoint's bd_size, else 32), ``sub_block_size``,
    ``threshold``, ``cache`` and ``attention`` as :class:`FastDLLMConfig` takes them."""
    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.spec_workers.reference import Decoder
    from diffspec.spec_workers.reference.decoder import load_tokenizer

    lm = load_dllm(info.path, dtype=options.get("dtype", torch.float32))
    config = FastDLLMConfig(cache=options["cache"], threshold=options["threshold"],
                            block_size=options.get("block_size"),
                            sub_block_size=options.get("sub_block_size"),
                            attention=options.get("attention", "trained"))
    block, _ = config.sizes(lm.info)  # checks the block against the checkpoint
    tokenizer = load_tokenizer(info)
    stops = tuple(dict.fromkeys([*lm.eos_token_ids, *([tokenizer.eos_token_id]
                                 if tokenizer.eos_token_id is not None else []),
                                 *turn_end_token_ids(tokenizer)]))
    return Decoder("fast_dllm", tokenizer, lambda requests: fast_dllm_generate(lm, requests, config),
                   stops, lm.max_positions, int(info.vocab_size or len(tokenizer)),
                   {**options, "block_size": block})
