"""What diffspec's methods on vLLM's diffusion path (the diffusion scheduler, the V2 model
runner) share, Fast-dLLM's (:mod:`diffspec.spec_workers.vllm.fast_dllm`) and ReFusion's
(:mod:`diffspec.spec_workers.vllm.refusion`): the model state's request bookkeeping
(:class:`DiffusionModelState`) and the base of their samplers (:class:`CanvasSampler`).

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/diffusion_state.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.sample.output import SamplerOutput

__all__ = ["FINISHED_KEPT", "CanvasSampler", "DiffusionModelState", "ForwardCounts",
           "ignored_sampling", "request_stops"]

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level


def request_stops(sampling_params: Any) -> list[int]:
    """The token ids that end a request, as vLLM's scheduler checks them (``check_stop``):
    ``stop_token_ids`` and, unless ``ignore_eos``, the EOS."""
    stops = set(getattr(sampling_params, "stop_token_ids", None) or ())
    eos = getattr(sampling_params, "eos_token_id", None)
    if eos is not None and not getattr(sampling_params, "ignore_eos", False):
        stops.add(int(eos))
    return sorted(stops)


FINISHED_KEPT = 256  # finished requests whose forward counts a model state keeps


class ForwardCounts(Mapping[str, int]):
    """The engine forwards each request took part in, by request id: every live request's
    count, and the counts of the last ``kept`` finished ones (oldest dropped first), so a
    server's model state holds at most ``max_num_reqs + kept`` of them however many
    requests it has served. A request that comes back (a preempted one, re-added) goes on
    from its count."""

    def __init__(self, kept: int = FINISHED_KEPT) -> None:
        self.kept = kept
        self.live: dict[str, int] = {}
        self.finished: OrderedDict[str, int] = OrderedDict()

    def start(self, req_id: str) -> None:
        """``req_id`` joins the batch (again)."""
        self.live[req_id] = self.finished.pop(req_id, self.live.get(req_id, 0))

    def count(self, req_id: str) -> None:
        """``req_id`` took part in one more forward."""
        self.live[req_id] = self.live.get(req_id, 0) + 1

    def finish(self, req_id: str) -> None:
        """``req_id`` left the batch: its count joins the finished ones (bounded)."""
        if req_id not in self.live:
            return
        self.finished[req_id] = self.live.pop(req_id)
        while len(self.finished) > self.kept:
            self.finished.popitem(last=False)

    def __getitem__(self, req_id: str) -> int:
        return self.live[req_id] if req_id in self.live else self.finished[req_id]

    def __iter__(self) -> Iterator[str]:
        yield from self.finished
        yield from self.live

    def __len__(self) -> int:
        return len(self.finished) + len(self.live)


class DiffusionModelState(DefaultModelState):
    """What diffspec's model states on vLLM's diffusion path share (Fast-dLLM's here,
    ReFusion's in :mod:`diffspec.spec_workers.vllm.refusion`): the generate task, no bonus
    token per forward, and the request bookkeeping: each request's decoding state by vLLM
    slot (``states``, which the sampler's ``add_request`` fills), the slot of each request
    id and the engine forwards each request took part in (``forwards``)."""

    num_new_sampled_tokens_per_step: int = 0  # a block / canvas forward samples no bonus token

    def __init__(self, vllm_config: VllmConfig, model: torch.nn.Module, encoder_cache: Any,
                 device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.states: dict[int, Any] = {}  # vLLM slot -> the request's decoding state
        self.slot_of: dict[str, int] = {}
        self.forwards = ForwardCounts()  # request id -> forwards it took part in

    def get_supported_generation_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def add_request(self, req_index: int, new_req_data: Any) -> None:
        super().add_request(req_index, new_req_data)
        self.slot_of[new_req_data.req_id] = req_index
        self.forwards.start(new_req_data.req_id)

    def remove_request(self, req_id: str) -> None:
        super().remove_request(req_id)
        self.forwards.finish(req_id)
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.states.pop(slot, None)

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        for req_id in input_batch.req_ids[: input_batch.num_reqs]:
            self.forwards.count(req_id)
        return super().prepare_inputs(input_batch, req_states)


def ignored_sampling(sampling_params: Any) -> list[str]:
    """The request's sampling settings that greedy diffusion decoding (Fast-dLLM's block
    rules, ReFusion's slot rules) ignores (vLLM refuses a temperature other than 1.0 for a
    diffusion model before the worker sees it)."""
    defaults = {"top_k": (0, -1, None), "top_p": (1.0, None), "repetition_penalty": (1.0, None),
                "frequency_penalty": (0.0, None), "presence_penalty": (0.0, None)}
    ignored = [f"{k} {getattr(sampling_params, k)}" for k, ok in defaults.items()
               if getattr(sampling_params, k, None) not in ok]
    extra = getattr(sampling_params, "extra_args", None) or {}
    # diffusion_canvas_length is honoured (ReFusion) or refused at admission unless it is
    # the served block (Fast-dLLM; patch refusion_requests): never ignored
    return ignored + [f"extra_args {k}" for k in extra
                      if str(k).startswith("diffusion_") and k != "diffusion_canvas_length"]


class CanvasSampler:
    """What the samplers of :class:`DiffusionModelState` share (they replace vLLM's sampler,
    its ``DiffusionSampler`` included, through ``ModelState.custom_sampler``): vLLM's
    per-request sampling states kept as the runner expects, no penalties, output buffers of
    ``width`` tokens per request, and ``add_request``, which warns of the sampling settings
    greedy decoding ignores and puts the request's decoding state (:meth:`new_state`) in
    ``state.states``. ``method`` and ``rules`` name the decoding in that warning."""

    method = "diffusion decoding"
    rules = "decoding"

    def __init__(self, sampler: Any, state: DiffusionModelState, width: int) -> None:
        self.sampling_states = sampler.sampling_states
        self.logprob_token_ids_state = sampler.logprob_token_ids_state
        self.req_states = sampler.req_states
        self.penalties_state = SimpleNamespace(output_bin_counts=None)  # no penalties
        self.compute_nans = False
        self.state, self.width = state, width
        n = state.max_num_reqs
        self._sampled = torch.zeros(n, width, dtype=torch.int32, device=state.device)
        self._num_sampled = torch.zeros(n, dtype=torch.int32, device=state.device)
        self._num_rejected = torch.zeros(n, dtype=torch.int32, device=state.device)

    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        ignored = ignored_sampling(sampling_params)
        if ignored:
            logger.warning("%s decodes greedily with its own %s rules; ignoring %s",
                           self.method, self.rules, ", ".join(ignored))
        self.sampling_states.add_request(req_idx, sampling_params)
        self.logprob_token_ids_state.add_request(req_idx, sampling_params)
        self.state.states[req_idx] = self.new_state(sampling_params)

    def new_state(self, sampling_params: Any) -> Any:
        """A new request's decoding state."""
        raise NotImplementedError

    def apply_staged_writes(self) -> None:
        self.sampling_states.apply_staged_writes()
        self.logprob_token_ids_state.apply_staged_writes()

    def _begin_step(self, input_batch: Any) -> tuple[int, list[int], np.ndarray, np.ndarray,
                                                      np.ndarray, np.ndarray, np.ndarray,
                                                      torch.Tensor]:
        """A step's request rows and its output buffers: ``(num_reqs, slots, cu, starts,
        query, emit, rejected, sampled)``: each row's vLLM slot, the rows' logits offsets
        ``cu`` and token offsets ``starts`` (``[num_reqs + 1]``), their scheduled tokens
        ``query``, and zeroed tokens to emit, tokens rejected and sampled tokens
        (``[num_reqs, width]``) for :meth:`_output`."""
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping_np[:num_reqs].tolist()
        cu = input_batch.cu_num_logits_np[: num_reqs + 1]
        starts = input_batch.query_start_loc_np[: num_reqs + 1]
        emit = np.zeros(num_reqs, dtype=np.int32)
        rejected = np.zeros(num_reqs, dtype=np.int32)
        sampled = torch.zeros(num_reqs, self.width, dtype=torch.long)
        return num_reqs, slots, cu, starts, np.diff(starts), emit, rejected, sampled

    def _step_requests(self, input_batch: Any, slots: list[int], cu: np.ndarray
                       ) -> Iterator[tuple[int, Any, int, bool]]:
        """Each request of the step but the dummy (profiling) ones: ``(i, state, rows,
        prefilled)``: its row ``i``, its decoding state, its rows of logits and whether its
        prompt's last prefill chunk ran in this step (no logits, prompt fully computed)."""
        for i, s in enumerate(slots):
            state = self.state.states.get(s)
            if state is not None:
                rows = int(cu[i + 1] - cu[i])
                yield i, state, rows, rows == 0 and self._prefill_done(input_batch, i)

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
        raise NotImplementedError(f"{self.method} returns no logprobs")
