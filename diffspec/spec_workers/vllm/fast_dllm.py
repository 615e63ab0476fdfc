"""Fast-dLLM on vLLM's diffusion path (``DiffusionConfig``, the diffusion scheduler, the V2
model runner), the way ``vllm/model_executor/models/diffusion_gemma.py`` drives it: a
:class:`FastDLLMModelState` (the model's ``get_model_state_cls()``) and the sampler it
installs (:class:`FastDLLMSampler`, through ``ModelState.custom_sampler``).

**Layout** (the reference's block-causal layout with a causal prompt, as NLD's diffusion
mode: :mod:`diffspec.spec_workers.reference.fast_dllm`, ``DiffusionLM(attention=
"block_causal", causal_prefix=True)``): the prompt is prefilled causally (vLLM's own
prefill, KV kept); generation is cut into blocks of ``canvas_length`` slots starting at the
prompt end; every forward of a block attends non-causally to the paged KV of the prompt and
the completed blocks and to the whole block. That is the reference's *prefix* cache.

**The data path.** vLLM schedules a diffusion request's draft tokens as its canvas: after
the prefill, each step runs the ``canvas_length`` draft tokens at the positions after the
committed ones. One request, one block:

1. *denoise* (every step while slots before the limit are masked): the sampler reads the
   block's logits (unshifted: slot ``j`` predicts its own token; the mask token never
   predicted) and commits, among the masked slots before the request's ``max_tokens``
   limit, every one with confidence > ``threshold`` and at least the top-1
   (:func:`diffspec.core.unmask.confidence_unmask`, the rule the reference decoder uses).
   Nothing is emitted: ``num_rejected`` = the whole block, so vLLM rolls the block's KV
   back by not advancing ``num_computed_tokens``;
2. *finish*: a request that committed a stop token with nothing masked before it, or its
   last slot before ``max_tokens``, emits its tokens on that step and vLLM's scheduler
   ends it (``num_rejected`` = the rest of the block);
3. *complete* (the request goes on): one more forward over the finished block, whose K/V
   are kept, emits the block's ``canvas_length`` tokens (``num_rejected = 0``); the next
   canvas is all masks.

Forwards per request are counted as the reference counts them: the prefill, every
denoise step and every completing forward (:attr:`FastDLLMModelState.forwards`).

Per request: ``max_tokens``, ``stop_token_ids`` and EOS (``ignore_eos``) as in
:class:`vllm.SamplingParams`, the threshold as ``extra_args={"fast_dllm_threshold": t}``
(default 0.9; 1.0 commits one slot per step); decoding is greedy (the reference decoder's;
a temperature is ignored with a warning). A block cut by ``max_model_len`` decodes only its
scheduled slots. A request that finished is done: a step vLLM already scheduled for it
(async scheduling) emits nothing.

Not done: shifted families (Dream, Fast-dLLM v2: their block-first slot is seeded from the
logit before the block, which a diffusion prefill in vLLM does not compute), sub-blocks,
the dual cache, Fast-dLLM's trained bidirectional layout for LLaDA / Dream (the prompt's KV
recomputed with the canvas at every block). vLLM's prefix caching reuses the KV of
completed blocks as it was written by their completing (block-non-causal) forward; a later
request whose prompt contains them would be prefilled causally by the reference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from diffspec.core.checkpoint import inspect_checkpoint
from diffspec.core.unmask import confidence_unmask

__all__ = ["BlockState", "FastDLLMModelState", "FastDLLMSampler", "block_outcome",
           "request_stops", "unmask_block"]

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level

PREFILL, DENOISE, COMPLETE, DONE = 0, 1, 2, 3  # a request's phase: what its next forward is
THRESHOLD_ARG = "fast_dllm_threshold"  # per-request SamplingParams.extra_args key
DEFAULT_THRESHOLD = 0.9


# ---------------------------------------------------------------------------- rules


def unmask_block(
    logits: torch.Tensor,  # [n, block, vocab], unshifted: entry j predicts slot j
    canvas: torch.Tensor,  # [n, block] int64, mask_token_id where masked
    limit: torch.Tensor,  # [n] int64: slots from here are past max_tokens, never decoded
    mask_token_id: int,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (canvas [n, block], committed [n, block] bool)
    """One Fast-dLLM step on a batch of blocks: commit every masked slot before ``limit``
    whose confidence exceeds ``threshold``, and at least the most confident one."""
    scores = logits.float().clone()
    scores[..., mask_token_id] = float("-inf")  # the mask token is never a prediction
    idx = torch.arange(canvas.shape[1], device=canvas.device)
    work = (canvas == mask_token_id) & (idx[None] < limit[:, None])
    candidates = torch.where(work, mask_token_id, -1)  # only the slots to decode are masked
    tokens, committed = confidence_unmask(scores, candidates, mask_token_id, threshold)
    return torch.where(committed, tokens, canvas), committed


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


def request_stops(sampling_params: Any) -> list[int]:
    """The token ids that end a request, as vLLM's scheduler checks them: ``stop_token_ids``
    and, unless ``ignore_eos``, the EOS."""
    stops = set(getattr(sampling_params, "stop_token_ids", None) or ())
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None and not getattr(sampling_params, "ignore_eos", False):
        stops.add(int(eos))
    return sorted(stops)


@dataclass
class BlockState:
    """One request's decoding state (host side), kept by its vLLM slot."""

    max_tokens: int
    stops: torch.Tensor  # [num_stop_ids] int64
    threshold: float
    canvas: torch.Tensor  # [block] int64: the current block, mask where still masked
    phase: int = PREFILL
    generated: int = 0  # tokens emitted so far (whole blocks)
    steps: list[int] = field(default_factory=list)  # forwards per decoded block

    def limit(self, block: int) -> tuple[int, bool]:
        """``(slots of this block before max_tokens, max_tokens ends in this block)``."""
        left = self.max_tokens - self.generated
        return min(block, left), left <= block


# ---------------------------------------------------------------------------- engine


class FastDLLMModelState(DefaultModelState):
    """vLLM model state of a diffusion LM decoded with Fast-dLLM: causal prefill, then
    non-causal block forwards (see the module docstring); the sampler does the rest."""

    num_new_sampled_tokens_per_step: int = 0  # a block forward samples no bonus token

    def __init__(self, vllm_config: VllmConfig, model: torch.nn.Module, encoder_cache: Any,
                 device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        diffusion = vllm_config.diffusion_config
        if diffusion is None or not diffusion.canvas_length:
            raise ValueError("Fast-dLLM needs a diffusion config (--diffusion-config "
                             "'{\"canvas_length\": BLOCK}')")
        info = inspect_checkpoint(self.model_config.model)
        if info.logits_shift:
            raise NotImplementedError(
                f"Fast-dLLM on vLLM serves unshifted diffusion-only families (LLaDA) so far; "
                f"{info.family} reads shifted logits (its block-first token is seeded "
                f"from the logit before the block, which vLLM's diffusion prefill does not "
                f"compute)")
        self.block_size = int(diffusion.canvas_length)
        self.mask_token_id = int(info.mask_token_id)  # type: ignore[arg-type]
        self.states: dict[int, BlockState] = {}  # vLLM slot -> state
        self.slot_of: dict[str, int] = {}
        self.forwards: dict[str, int] = {}  # request id -> forwards it took part in
        self._causal = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)

    def get_supported_generation_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
        return FastDLLMSampler(sampler, self), None

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        super().add_request(req_index, new_req_data)
        self.slot_of[new_req_data.req_id] = req_index
        self.forwards.setdefault(new_req_data.req_id, 0)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.states.pop(slot, None)

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        for req_id in input_batch.req_ids[: input_batch.num_reqs]:
            self.forwards[req_id] = self.forwards.get(req_id, 0) + 1
        return super().prepare_inputs(input_batch, req_states)

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


class FastDLLMSampler:
    """Replaces vLLM's sampler for a Fast-dLLM model (``ModelState.custom_sampler``): turns
    each step's block logits into committed slots, the next canvas (the request's draft
    tokens) and the tokens to emit."""

    def __init__(self, sampler: Any, state: FastDLLMModelState) -> None:
        self.sampling_states = sampler.sampling_states
        self.logprob_token_ids_state = sampler.logprob_token_ids_state
        self.req_states = sampler.req_states
        self.penalties_state = SimpleNamespace(output_bin_counts=None)  # no penalties
        self.compute_nans = False
        self.state = state
        block, n = state.block_size, state.max_num_reqs
        self._sampled = torch.zeros(n, block, dtype=torch.int32, device=state.device)
        self._num_sampled = torch.zeros(n, dtype=torch.int32, device=state.device)
        self._num_rejected = torch.zeros(n, dtype=torch.int32, device=state.device)

    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        if getattr(sampling_params, "temperature", 0.0) not in (0.0, None):
            logger.warning("Fast-dLLM decodes greedily; ignoring temperature %s",
                           sampling_params.temperature)
        self.sampling_states.add_request(req_idx, sampling_params)
        self.logprob_token_ids_state.add_request(req_idx, sampling_params)
        block = self.state.block_size
        extra = getattr(sampling_params, "extra_args", None) or {}
        threshold = float(extra.get(THRESHOLD_ARG, DEFAULT_THRESHOLD))
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"{THRESHOLD_ARG} must lie in [0, 1], got {threshold}")
        self.state.states[req_idx] = BlockState(
            max_tokens=int(sampling_params.max_tokens),
            stops=torch.tensor(request_stops(sampling_params), dtype=torch.long),
            threshold=threshold,
            canvas=torch.full((block,), self.state.mask_token_id, dtype=torch.long),
        )

    def apply_staged_writes(self) -> None:
        self.sampling_states.apply_staged_writes()
        self.logprob_token_ids_state.apply_staged_writes()

    def __call__(self, logits: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> SamplerOutput:
        # logits: [num_logits, vocab]; a block request has canvas_length rows, a prefill none
        state, block, mask = self.state, self.state.block_size, self.state.mask_token_id
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping_np[:num_reqs].tolist()
        cu = input_batch.cu_num_logits_np[: num_reqs + 1]
        query = np.diff(input_batch.query_start_loc_np[: num_reqs + 1])
        emit = np.zeros(num_reqs, dtype=np.int32)
        rejected = np.zeros(num_reqs, dtype=np.int32)
        sampled = torch.zeros(num_reqs, block, dtype=torch.long)
        denoise = [i for i, s in enumerate(slots)
                   if s in state.states and state.states[s].phase == DENOISE and cu[i + 1] > cu[i]]
        if denoise:
            # a block cut by max_model_len has fewer rows: its slots past them are never decoded
            rows = torch.zeros(len(denoise), block, logits.shape[-1], dtype=torch.float32)
            limits = []
            for k, i in enumerate(denoise):
                n_rows = int(cu[i + 1] - cu[i])
                rows[k, :n_rows] = logits[int(cu[i]) : int(cu[i + 1])].float().cpu()
                lim, ends_here = state.states[slots[i]].limit(block)
                limits.append((min(lim, n_rows), ends_here or n_rows < block))
            canvas = torch.stack([state.states[slots[i]].canvas for i in denoise])
            limit = torch.tensor([lim for lim, _ in limits])
            thresholds = [state.states[slots[i]].threshold for i in denoise]
            new = canvas.clone()
            for t in sorted(set(thresholds)):  # confidence_unmask takes one threshold
                rows_t = torch.tensor([x == t for x in thresholds])
                new[rows_t] = unmask_block(rows[rows_t], canvas[rows_t], limit[rows_t],
                                           mask, t)[0]
            for k, i in enumerate(denoise):
                st = state.states[slots[i]]
                st.canvas = new[k]
                n, complete = block_outcome(st.canvas, *limits[k], st.stops, mask)
                if complete:
                    st.phase = COMPLETE
                elif n:  # finished: a step already in flight (async scheduling) emits nothing
                    st.phase = DONE
                emit[i], rejected[i] = n, int(query[i]) - n
                sampled[i, :n] = st.canvas[:n]
        for i, s in enumerate(slots):
            st = state.states.get(s)
            if st is None:  # a dummy (profiling) request
                continue
            if st.phase == PREFILL:
                if cu[i + 1] == cu[i] and self._prefill_done(input_batch, i):
                    st.phase = DENOISE
            elif st.phase == COMPLETE and i not in denoise:  # the completing forward
                emit[i] = block
                sampled[i] = st.canvas
                st.generated += block
                st.canvas = torch.full((block,), mask, dtype=torch.long)
                st.phase = DENOISE
            elif st.phase == DONE and i not in denoise:
                rejected[i] = int(query[i])
            self.req_states.draft_tokens[s, :block] = st.canvas.to(self.req_states.draft_tokens.device)
        return self._output(num_reqs, sampled, emit, rejected)

    @staticmethod
    def _prefill_done(input_batch: Any, i: int) -> bool:
        """True when request ``i``'s prompt is fully computed after this step."""
        return bool(input_batch.num_computed_prefill_tokens_np[i]
                    + input_batch.num_scheduled_tokens[i] >= input_batch.prefill_len_np[i])

    def _output(self, num_reqs: int, sampled: torch.Tensor, emit: np.ndarray,
                rejected: np.ndarray) -> SamplerOutput:
        out = self._sampled[:num_reqs]
        out.copy_(sampled.to(out.dtype))
        num_sampled = self._num_sampled[:num_reqs]
        num_sampled.copy_(torch.from_numpy(emit))
        num_rejected = self._num_rejected[:num_reqs]
        num_rejected.copy_(torch.from_numpy(rejected))
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None, num_nans=None,
                             num_sampled=num_sampled, num_rejected=num_rejected)

    def get_logprobs_dims(self, *_: Iterable[Any], **__: Any) -> Any:
        raise NotImplementedError("Fast-dLLM returns no logprobs")
