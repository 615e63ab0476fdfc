"""Fast-dLLM on vLLM's diffusion path (the diffusion scheduler, the V2 model runner), driven
as vLLM's DiffusionGemma is: :class:`FastDLLMModelState` and its :class:`FastDLLMSampler`.
Serves LLaDA, Dream, Fast-dLLM v2 and NLD's diffusion mode.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/fast_dllm.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from diffspec.core.unmask import unmask_block
from diffspec.methods import get_method
from diffspec.plugin.vllm.dllm import THRESHOLD_ARG
from diffspec.spec_workers.vllm.diffusion_state import (
    CanvasSampler,
    DiffusionModelState,
    request_stops,
)
from diffspec.spec_workers.vllm.proposer import DRAFT_LOGITS_ROWS

__all__ = ["BlockState", "FastDLLMModelState", "FastDLLMSampler", "begin_blocks",
           "block_outcome", "complete_block", "denoise_step", "seed_token"]

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level

PREFILL, DENOISE, COMPLETE, DONE = 0, 1, 2, 3  # a request's phase: what its next forward is
DEFAULT_THRESHOLD = get_method("fast_dllm").defaults["threshold"]  # the registry's


# ---------------------------------------------------------------------------- rules


def seed_token(logits: torch.Tensor, mask_token_id: int) -> int:
    """A shifted family's block-first token: the argmax of the logit row before the block
    (``[vocab]``), the mask token excluded."""
    scores = logits.float().clone()
    scores[mask_token_id] = float("-inf")
    return int(scores.argmax())


def block_outcome(
    canvas: torch.Tensor,  # [block] int64
    limit: int,  # slots before max_tokens
    ends_here: bool,  # max_tokens ends in this block
    stops: torch.Tensor,  # [num_stop_ids] int64
    mask_token_id: int,
) -> tuple[int, bool]:
    """``(emit, complete)`` for one request after a step: ``emit > 0`` when it finishes now
    with its first ``emit`` slots (a stop token with nothing masked before it, or every slot
    before a ``max_tokens`` limit that ends here); ``complete`` when every slot before the
    limit is committed and the request goes on (its completing forward comes next)."""
    gen = canvas[:limit]
    masked = gen == mask_token_id
    hits = (torch.isin(gen, stops) & ~masked).nonzero()
    if hits.numel():
        first = int(hits[0, 0])
        if not bool(masked[:first].any()):
            return first + 1, False
    if bool(masked.any()):
        return 0, False
    return (limit, False) if ends_here else (0, True)


@dataclass
class BlockState:
    """One request's decoding state (host side), kept by its vLLM slot."""

    max_tokens: int
    stops: torch.Tensor  # [num_stop_ids] int64
    threshold: float
    canvas: torch.Tensor  # [block] int64: the current block, mask where still masked
    phase: int = PREFILL
    generated: int = 0  # tokens emitted so far by completed blocks

    def limit(self, block: int) -> tuple[int, bool]:
        """``(slots of this block before max_tokens, max_tokens ends in this block)``."""
        left = self.max_tokens - self.generated
        return min(block, left), left <= block


def _finish(state: BlockState, rows: int, block: int, mask_token_id: int) -> tuple[int, bool]:
    """:func:`block_outcome` of the state's canvas when ``rows`` slots were scheduled."""
    limit, ends_here = state.limit(block)
    return block_outcome(state.canvas, min(limit, rows), ends_here or rows < block,
                         state.stops, mask_token_id)


def begin_blocks(state: BlockState, last_logits: torch.Tensor | None, block: int,
                 mask_token_id: int) -> int:
    """After the prompt's last prefill chunk: the first block starts. A shifted family
    (``last_logits``: the prompt's last logit row) seeds its first slot; returns how many
    tokens the request emits now (1 when that seed already ends it, else 0)."""
    state.phase = DENOISE
    if last_logits is None:
        return 0
    state.canvas[0] = seed_token(last_logits, mask_token_id)
    emit, _ = _finish(state, block, block, mask_token_id)
    if emit:
        state.phase = DONE
    return emit


def denoise_step(states: list[BlockState], logits: torch.Tensor, rows: list[int], block: int,
                 mask_token_id: int, *, sub_block: int | None, shifted: bool) -> list[int]:
    """One denoise forward of a batch of requests: ``logits`` ``[n, block, vocab]`` (row
    ``j`` computed at slot ``j``; ``rows[k]`` of them scheduled, the rest padding). Updates
    each state's canvas and phase; returns the tokens each request emits now."""
    emit = [0] * len(states)
    todo = []
    for k, st in enumerate(states):  # a seed (the completing forward's) may end a request
        n, _ = _finish(st, rows[k], block, mask_token_id)
        if n:
            emit[k], st.phase = n, DONE
        else:
            todo.append(k)
    if not todo:
        return emit
    device = logits.device
    canvas = torch.stack([states[k].canvas for k in todo]).to(device)
    limit = torch.tensor([min(states[k].limit(block)[0], rows[k]) for k in todo],
                         device=device)
    thresholds = [states[k].threshold for k in todo]
    new = canvas.clone()
    sel_logits = logits[torch.tensor(todo, device=device)]
    for t in sorted(set(thresholds)):  # confidence_unmask takes one threshold
        pick = torch.tensor([x == t for x in thresholds], device=device)
        new[pick] = unmask_block(sel_logits[pick], canvas[pick], limit[pick], mask_token_id,
                                 t, sub_block=sub_block, shifted=shifted)[0]
    new = new.cpu()
    for j, k in enumerate(todo):
        st = states[k]
        st.canvas = new[j]
        n, complete = _finish(st, rows[k], block, mask_token_id)
        if complete:
            st.phase = COMPLETE
        elif n:
            emit[k], st.phase = n, DONE
    return emit


def complete_block(state: BlockState, last_logits: torch.Tensor | None, block: int,
                   mask_token_id: int) -> torch.Tensor:
    """After the completing forward: the block's tokens (``[block]``, all emitted); the
    next canvas is all masks, its first slot seeded for a shifted family (``last_logits``:
    this forward's last logit row)."""
    tokens = state.canvas
    state.generated += block
    state.canvas = torch.full((block,), mask_token_id, dtype=torch.long)
    if last_logits is not None:
        state.canvas[0] = seed_token(last_logits, mask_token_id)
    state.phase = DENOISE
    return tokens


# ---------------------------------------------------------------------------- engine


class FastDLLMModelState(DiffusionModelState):
    """vLLM model state of a diffusion LM decoded with Fast-dLLM: causal prefill, then
    non-causal block forwards (see the module docstring); the sampler does the rest."""

    states: dict[int, BlockState]

    def __init__(self, vllm_config: VllmConfig, model: torch.nn.Module, encoder_cache: Any,
                 device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        diffusion = vllm_config.diffusion_config
        extra = vllm_config.additional_config if isinstance(
            vllm_config.additional_config, dict) else {}
        settings = (extra.get("diffspec") or {}).get("fast_dllm")
        if diffusion is None or not diffusion.canvas_length or not settings:
            raise ValueError(
                "load diffspec's vLLM plugin in every vLLM process (it is the "
                "vllm.general_plugins entry point 'diffspec'): Fast-dLLM's settings were not "
                "resolved by its config hook (diffspec.plugin.vllm.dllm)")
        self.block_size = int(diffusion.canvas_length)
        self.sub_block_size = int(settings["sub_block_size"])
        self.threshold = float(settings["threshold"])
        self.mask_token_id = int(settings["mask_token_id"])
        self.logits_shift = bool(settings["logits_shift"])
        if self.logits_shift and getattr(model, "fast_dllm_hidden", None) is None:
            raise ValueError(f"{type(model).__name__} keeps no hidden states "
                             f"(diffspec.model_executors.vllm.dllm.FastDLLMModel): a shifted "
                             f"family's first token cannot be seeded")
        self._causal = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
        return FastDLLMSampler(sampler, self), None

    def prepare_attn(
        self, input_batch: Any, cudagraph_mode: CUDAGraphMode, block_tables: Any,
        slot_mappings: torch.Tensor, attn_groups: Any, kv_cache_config: Any,
        for_capture: bool = False, ubatch_idx: int = 0, **_: Any,
    ) -> dict[str, Any]:
        """vLLM's attention metadata with per-request causality: causal for a prefill,
        non-causal for a block (denoise or completing forward)."""
        full = cudagraph_mode == CUDAGraphMode.FULL
        num_reqs = input_batch.num_reqs_after_padding if full else input_batch.num_reqs
        num_tokens = input_batch.num_tokens_after_padding if full else input_batch.num_tokens
        slots = input_batch.idx_mapping_np[: input_batch.num_reqs].tolist()
        causal = [1 if self.states.get(s) is None or self.states[s].phase == PREFILL else 0
                  for s in slots]
        self._causal[: len(causal)].copy_(torch.tensor(causal, dtype=torch.int32))
        self._causal[len(causal) : num_reqs] = 0
        seq_upper = input_batch.seq_lens_cpu_upper_bound
        max_seq_len = (self.max_model_len if for_capture
                       else int(seq_upper[:num_reqs].max().item()))
        return build_attn_metadata(
            attn_groups=attn_groups,
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            query_start_loc_gpu=input_batch.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=torch.from_numpy(input_batch.query_start_loc_np[: num_reqs + 1]),
            max_query_len=int(input_batch.num_scheduled_tokens.max()),
            seq_lens=input_batch.seq_lens,
            max_seq_len=max_seq_len,
            block_tables=block_tables,
            slot_mappings=slot_mappings,
            kv_cache_config=kv_cache_config,
            seq_lens_cpu_upper_bound=seq_upper,
            positions=input_batch.positions,
            is_prefilling=torch.from_numpy(input_batch.is_prefilling_np),
            for_cudagraph_capture=for_capture,
            causal=self._causal[:num_reqs],
            req_idx=input_batch.idx_mapping_np,
            ubatch_idx=ubatch_idx,
        )


class FastDLLMSampler(CanvasSampler):
    """Replaces vLLM's sampler for a Fast-dLLM model: turns each step's block logits into
    committed slots, the next canvas (the request's draft tokens) and the tokens to emit,
    with the rules above."""

    method, rules = "Fast-dLLM", "block"

    def __init__(self, sampler: Any, state: FastDLLMModelState) -> None:
        super().__init__(sampler, state, state.block_size)

    def new_state(self, sampling_params: Any) -> BlockState:
        block = self.state.block_size
        extra = getattr(sampling_params, "extra_args", None) or {}
        threshold = extra.get(THRESHOLD_ARG, self.state.threshold)
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            threshold = -1.0
        if not 0.0 <= threshold <= 1.0:
            logger.warning("extra_args %s must lie in [0, 1], got %r; using %s", THRESHOLD_ARG,
                           extra.get(THRESHOLD_ARG), self.state.threshold)
            threshold = self.state.threshold
        return BlockState(
            max_tokens=int(sampling_params.max_tokens),
            stops=torch.tensor(request_stops(sampling_params), dtype=torch.long),
            threshold=threshold,
            canvas=torch.full((block,), self.state.mask_token_id, dtype=torch.long),
        )

    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> SamplerOutput:
        # logits: [num_logits, vocab]; a block request has its scheduled rows, a prefill none
        state, block, mask = self.state, self.state.block_size, self.state.mask_token_id
        num_reqs, slots, cu, starts, query, emit, rejected, sampled = self._begin_step(
            input_batch)
        seeds, denoise, complete = [], [], []
        for i, st, rows, prefilled in self._step_requests(input_batch, slots, cu):
            if st.phase == PREFILL:
                if prefilled:
                    if state.logits_shift:
                        seeds.append(i)
                    else:
                        begin_blocks(st, None, block, mask)
            elif st.phase == DONE:  # a step scheduled before the finish was seen
                rejected[i] = int(query[i])
            elif rows and rows < block and (int(input_batch.num_computed_tokens_np[i]) + rows
                                            < state.max_model_len):
                # the scheduler cut this canvas for its token budget (not max_model_len):
                # the forward saw part of the block; discard it, the block is rescheduled
                rejected[i] = int(query[i])
            elif st.phase == DENOISE and rows:
                denoise.append(i)
            elif st.phase == COMPLETE and rows:
                complete.append(i)
        if seeds:
            seed_logits = self._prompt_logits([int(starts[i + 1]) - 1 for i in seeds])
            for k, i in enumerate(seeds):
                st = state.states[slots[i]]
                n = begin_blocks(st, seed_logits[k], block, mask)
                emit[i] = n
                sampled[i, :n] = st.canvas[:n]
        per = max(1, DRAFT_LOGITS_ROWS // block)  # requests a part: its copies bounded
        for part in (denoise[p : p + per] for p in range(0, len(denoise), per)):
            rows = [int(cu[i + 1] - cu[i]) for i in part]
            blocks = logits.new_zeros(len(part), block, logits.shape[-1])
            for k, i in enumerate(part):
                blocks[k, : rows[k]] = logits[int(cu[i]) : int(cu[i + 1])]
            states = [state.states[slots[i]] for i in part]
            emitted = denoise_step(states, blocks, rows, block, mask,
                                   sub_block=state.sub_block_size, shifted=state.logits_shift)
            for k, i in enumerate(part):
                emit[i], rejected[i] = emitted[k], int(query[i]) - emitted[k]
                sampled[i, : emitted[k]] = states[k].canvas[: emitted[k]]
        for i in complete:  # the completing forward: the block's KV kept, its tokens out
            st = state.states[slots[i]]
            last = logits[int(cu[i + 1]) - 1] if state.logits_shift else None
            tokens = complete_block(st, last, block, mask)
            emit[i] = block
            sampled[i] = tokens
        self._write_canvases(slots)
        return self._output(num_reqs, sampled, emit, rejected)

    def _prompt_logits(self, rows: list[int]) -> torch.Tensor:  # [len(rows), vocab]
        """The logits of the given token rows of this step's forward, from the hidden
        states the model kept (vLLM computes no logits for a diffusion prefill)."""
        model = self.state.model
        hidden = model.fast_dllm_hidden
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return model.compute_logits(hidden.index_select(0, index))

    def _write_canvases(self, slots: list[int]) -> None:
        """Every request's canvas becomes its draft tokens: the tokens of its next forward."""
        live = [s for s in slots if s in self.state.states]
        if not live:
            return
        draft = self.req_states.draft_tokens
        index = torch.tensor(live, dtype=torch.long, device=draft.device)
        canvases = torch.stack([self.state.states[s].canvas for s in live])
        draft[index, : self.state.block_size] = canvases.to(draft.device, draft.dtype)

