"""What diffspec's SGLang speculative workers share (the two-pass step of
:mod:`~diffspec.spec_workers.sglang.two_pass` and TiDAR's one-forward step of
:mod:`~diffspec.spec_workers.sglang.tidar`): both draft with the served model itself on its
KV pool, so a worker is :class:`TargetModelSpecWorker` with its prefill and decode; the state
carried between steps (:class:`SpecDraftInput`); SGLang's own decode forward for a step that
drafts nothing; the accept rules on SGLang's sampling parameters (:func:`accept`); the
adaptive policy and its Prometheus counters; and the per-request refusals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from diffspec.core.accept import AcceptOutput, greedy_accept, rejection_sample_accept
from diffspec.core.sampling import process_logits
from diffspec.model_executors.sglang import views
from diffspec.spec_workers.sglang.policy import adaptive_policy, prompt_lookup
from diffspec.spec_workers.sglang.requests import refuse_unsupported_requests

__all__ = ["SpecDraftInput", "StepLogits", "TargetModelSpecWorker",
           "accept", "adaptive_policy", "choice_metrics", "measure_profile", "prompt_lookup",
           "remaining",
           "request_penalties", "step_logits"]

logger = logging.getLogger("diffspec")



@dataclass
class SpecDraftInput(SpecInput):
    """Per-request state carried from one step to the next (filtered / merged with the
    batch by the scheduler)."""

    bonus_tokens: torch.Tensor  # [bs] the anchor: last emitted token, no K/V yet
    new_seq_lens: torch.Tensor  # [bs] committed K/V length C

    # read by SGLang's generic relay code; this algorithm carries no hidden state
    topk_p: ClassVar[torch.Tensor | None] = None
    topk_index: ClassVar[torch.Tensor | None] = None
    hidden_states: ClassVar[torch.Tensor | None] = None
    future_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # neither a draft nor a verify input: state between steps (as UNO's carried state)
        super().__init__(SpecInputType.UNO_STATE)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu=None) -> None:
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.new_seq_lens = self.new_seq_lens[new_indices]

    def merge_batch(self, other: SpecDraftInput) -> None:
        if not isinstance(other, SpecDraftInput):
            raise TypeError(f"cannot merge SpecDraftInput with {type(other).__name__}")
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])
        self.new_seq_lens = torch.cat([self.new_seq_lens, other.new_seq_lens])


class TargetModelSpecWorker(BaseSpecWorker):
    """What every diffspec SGLang worker shares: it drafts with the served (target) model
    itself, on the target's KV pool, so it has no draft worker and no private state; it
    answers the scheduler's other questions through the target worker; it refuses, per
    batch, the request options it cannot honour. Subclasses implement ``_prefill`` and
    ``_decode``."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__()
        from sglang.srt.runtime_context import get_spec

        self.method = str(server_args.speculative_algorithm).lower()  # orthrus, tidar, ...
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.width = int(get_spec().speculative_num_draft_tokens)  # W = anchor + drafts
        self.speculative_num_draft_tokens = self.width
        self.speculative_num_steps = 1
        self.topk = 1

    def _adaptive_policy(self, max_drafts: int, cost: str):
        """The adaptive draft-count policy of the served model's config
        (:func:`~diffspec.spec_workers.sglang.policy.adaptive_policy`) under this server's
        arguments: step times tracked with one tensor-parallel rank only, off under
        ``--enable-deterministic-inference``."""
        return adaptive_policy(
            self.model_runner.model_config.hf_config, max_drafts, cost, self.method,
            track_step_times=self.server_args.tp_size == 1,
            deterministic=bool(getattr(self.server_args, "enable_deterministic_inference",
                                       False)))

    @property
    def draft_worker(self):
        return None  # every pass runs the target model on the target KV pool

    # tokens per request of the widest step the adaptive policy can choose (the start-up
    # profile times forwards up to this many tokens per running request)
    @property
    def profile_tokens_per_request(self) -> int:
        return self.width

    # the most tokens one step's forward runs, whatever the batch (None: no bound of the
    # worker's own; TIDAR: SGLang's activation budget), the start-up profile's widest
    @property
    def profile_max_tokens(self) -> int | None:
        return None

    def clear_cache_pool(self) -> None:
        pass  # no private state outside SGLang's pools

    def __getattr__(self, name: str):
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ---------------------------------------------------------------------- scheduler API

    def init_cuda_graphs(self, *args, **kwargs) -> None:
        """SGLang's scheduler calls this on the speculative worker after the target's, once
        the KV pools and attention backends exist (``Scheduler.init_model_worker``: memory
        pools, attention backends, then graphs): the target worker's own capture, as
        before, then the adaptive policy's latency profile, measured on this model runner
        (:meth:`measure_latency_profile`)."""
        self._target_worker.init_cuda_graphs(*args, **kwargs)
        self.measure_latency_profile()

    def measure_latency_profile(self) -> None:
        """Give the adaptive policy (when it has no profile: on by default, no
        ``latency_profile`` given) the latency profile of this model runner's own forwards,
        from diffspec's cache or timed now (:func:`measure_profile`). Idempotent."""
        policy = getattr(self, "adaptive", None)
        if policy is not None and policy.profile is None:
            policy.set_profile(measure_profile(self.model_runner, self.server_args,
                                               self.method, policy.max_drafts,
                                               self.profile_tokens_per_request,
                                               self.profile_max_tokens))

    def forward_batch_generation(
        self, batch, on_publish=None, **_: object
    ) -> GenerationBatchResult:
        policy = getattr(self, "adaptive", None)
        timed = policy is not None and policy.track_step_times
        if batch.forward_mode.is_extend() and not batch.forward_mode.is_target_verify():
            refuse_unsupported_requests(batch, self.method)
            if timed:  # a prefill: the step around it is not learned from
                policy.step_started(())
                self._step_emitted = None
            return self._prefill(batch, on_publish)
        if batch.forward_mode.is_decode():
            refuse_unsupported_requests(batch, self.method)  # (all were, at their prefill)
            if timed:  # the decode step before this one ended now: its wall time
                policy.step_started([req.rid for req in batch.reqs],
                                    getattr(self, "_step_emitted", None))
            result = self._decode(batch, on_publish)
            if timed:
                self._step_emitted = int(result.accept_lens.sum())
            return result
        raise RuntimeError(f"{self.method}: unexpected batch mode {batch.forward_mode} "
                           f"(idle and mixed batches are not supported)")

    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        raise NotImplementedError

    @staticmethod
    def _prefilled(result: GenerationBatchResult, batch, state: SpecInput,
                   on_publish) -> GenerationBatchResult:
        """A prefill's result, carrying ``state`` to the request's first decode step, with
        the committed lengths (the prompt's K/V) published to the scheduler."""
        result.next_draft_input = state
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    @staticmethod
    def _decoded(out: torch.Tensor, accept_lens: torch.Tensor, new_seq_lens: torch.Tensor,
                 state: SpecInput, width: int, on_publish) -> GenerationBatchResult:
        """A decode step's result: ``out`` ``[bs, width]`` the emitted tokens of each
        request then -1, ``accept_lens`` ``[bs]`` how many, ``state`` carried to the next
        step; the committed lengths are published to the scheduler."""
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=out.clamp(min=0).reshape(-1),
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=state,
            speculative_num_draft_tokens=width,
            speculative_output_stride=width,
            num_non_draft_tokens_per_req=1,
        )

    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        raise NotImplementedError

    def _run_model(self, forward_batch: ForwardBatch, call=None):
        """``call()`` (default: the served model's own forward on ``forward_batch``) with
        the attention metadata planned by SGLang's backend, inside SGLang's forward
        context, as its model runner runs a forward (without its static input buffers,
        which hold at most one row per running request)."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        backend = self.model_runner.attn_backend
        backend.init_forward_metadata(forward_batch)
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            if call is not None:
                return call()
            return self.model_runner.model(forward_batch.input_ids, forward_batch.positions,
                                           forward_batch)

    @property
    def _torch_native(self) -> bool:
        """SGLang's torch-native attention backend (the CPU path: no custom-mask path, and an
        extend kernel quadratic in the context), asked per step (SGLang builds the backend
        after the worker)."""
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return isinstance(self.model_runner.attn_backend, TorchNativeAttnBackend)

    def _decode_forward(
        self,
        batch,
        anchors: torch.Tensor,  # [bs] the token each request decodes from
        slots: torch.Tensor,  # [bs] KV-pool slots of position C
    ) -> torch.Tensor:  # [bs, 1, vocab] fp32 logits
        """SGLang's own DECODE forward (what plain AR runs: its decode attention kernels,
        and CUDA graphs where captured) for a step that drafts nothing, rather than a
        one-token TARGET_VERIFY: the torch-native backend runs a verify as an extend over
        the whole sequence, which costs far more than a decode. The batch's lengths count
        the new token for the forward (positions C = seq_lens - 1) and are restored."""
        saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info)
        bs = len(anchors)
        batch.forward_mode = ForwardMode.DECODE
        batch.input_ids = anchors
        batch.out_cache_loc = slots
        batch.spec_info = None  # a decode with spec_info reads as a draft decode
        batch.seq_lens = saved[0] + 1
        if saved[1] is not None:
            batch.seq_lens_cpu = saved[1] + 1
        if saved[2] is not None:
            batch.seq_lens_sum = saved[2] + bs
        try:
            forward_batch = ForwardBatch.init_new(batch, self.model_runner,
                                                  return_hidden_states_before_norm=False)
            result = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True)  # no sampling
        finally:
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = saved
        logits = result.logits_output.next_token_logits  # [bs, padded vocab]
        vocab = self.model_runner.model.config.vocab_size
        return logits[:, :vocab].float().view(bs, 1, vocab)


def remaining(req) -> int:
    """Tokens ``req`` may still emit (``max_new_tokens``, which SGLang caps at the context
    end, minus its output so far)."""
    return int(req.sampling_params.max_new_tokens) - len(req.output_ids)


# ChoiceMetrics' unlabelled counters: (attribute, Prometheus name, help)
_CHOICE_COUNTERS = (
    ("draft_tokens", "diffspec:adaptive_draft_tokens",
     "Draft tokens diffspec's adaptive policy chose (over requests and steps)"),
    ("lookup_blocks", "diffspec:prompt_lookup_blocks",
     "Requests' per-step drafts that came from prompt lookup"),
    ("lookup_tokens", "diffspec:prompt_lookup_draft_tokens", "Draft tokens from prompt lookup"),
    ("draft_blocks", "diffspec:draft_blocks",
     "Requests' per-step drafts the diffusion view drafted"),
    ("skipped", "diffspec:draft_forwards_skipped",
     "Drafting steps with no draft forward (every draft from prompt lookup or carried)"),
    ("carried_blocks", "diffspec:carried_blocks",
     "Requests' per-step drafts carried over from their last over-drafted block"),
    ("carried_tokens", "diffspec:carried_draft_tokens", "Carried draft tokens"),
)


class ChoiceMetrics:
    """The adaptive policy's choices as Prometheus counters (``prometheus_client``, which
    SGLang uses): ``diffspec:adaptive_steps_total{drafts="k"}``, decode steps by the draft
    count chosen for the step, and ``diffspec:adaptive_draft_tokens_total``, draft tokens
    chosen (k times the batch). With ``--enable-metrics`` SGLang puts prometheus_client in
    multiprocess mode before its scheduler starts, so they show in its ``/metrics`` next to
    its own. (SGLang's own ``spec_num_proposed_drafts`` counts ``W - 1`` per verify step,
    the server's width, whatever a step drafted.) With prompt lookup:
    ``diffspec:prompt_lookup_blocks_total`` (a request's drafts in one step that came from
    lookup), ``diffspec:prompt_lookup_draft_tokens_total``, ``diffspec:draft_blocks_total``
    (those the diffusion view drafted), ``diffspec:carried_blocks_total`` and
    ``diffspec:carried_draft_tokens_total`` (drafts carried over from an over-drafted
    block, :mod:`diffspec.core.carry`) and ``diffspec:draft_forwards_skipped_total`` (steps
    that drafted by lookup or carried drafts alone, with no draft forward)."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.steps = Counter("diffspec:adaptive_steps", "Decode steps of diffspec's adaptive "
                             "self-speculation, by the draft count chosen for the step",
                             ["drafts"])
        for attr, name, doc in _CHOICE_COUNTERS:
            setattr(self, attr, Counter(name, doc))

    def record(self, drafts: int, batch_size: int) -> None:
        self.steps.labels(drafts=str(drafts)).inc()
        self.draft_tokens.inc(drafts * batch_size)

    def record_sources(self, lookup: list[int], diffusion: int,
                       carried: list[int] | tuple = ()) -> None:
        """One drafting step: ``lookup`` each lookup-drafting request's draft count,
        ``diffusion`` the requests the diffusion view drafted for, ``carried`` each
        request's carried draft count."""
        self.lookup_blocks.inc(len(lookup))
        self.lookup_tokens.inc(sum(lookup))
        self.carried_blocks.inc(len(carried))
        self.carried_tokens.inc(sum(carried))
        self.draft_blocks.inc(diffusion)
        if not diffusion:
            self.skipped.inc()


_CHOICE_METRICS: list[ChoiceMetrics] = []


def choice_metrics() -> ChoiceMetrics:
    """The process's one :class:`ChoiceMetrics` (Prometheus refuses a metric registered
    twice)."""
    if not _CHOICE_METRICS:
        _CHOICE_METRICS.append(ChoiceMetrics())
    return _CHOICE_METRICS[0]


def request_penalties(req, vocab_size: int):
    """SGLang request ``req``'s penalties, ``min_new_tokens`` (with SGLang's stop-token set:
    the request's stop ids, its EOS ids, the tokenizer's EOS and extra stop ids) and logit
    bias, as :class:`~diffspec.core.penalties.RequestPenalties`."""
    from diffspec.core.penalties import RequestPenalties

    params = req.sampling_params
    stop: set[int] = set()
    if params.min_new_tokens > 0:
        tokenizer = getattr(req, "tokenizer", None)
        stop |= set(params.stop_token_ids or ()) | set(req.eos_token_ids or ())
        stop |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stop.add(tokenizer.eos_token_id)
    bias = None
    if params.logit_bias:
        bias = {int(k): float(v) for k, v in params.logit_bias.items()
                if 0 <= int(k) < vocab_size}
    return RequestPenalties(
        repetition=float(params.repetition_penalty), frequency=float(params.frequency_penalty),
        presence=float(params.presence_penalty), min_new_tokens=int(params.min_new_tokens),
        stop_token_ids=frozenset(t for t in stop if t is not None), logit_bias=bias)


def accept(
    drafts: torch.Tensor,  # [bs, W - 1] draft token ids
    logits: torch.Tensor | StepLogits,  # [bs, W, vocab] AR logits of [anchor, drafts]
    batch,  # SGLang's ScheduleBatch (its reqs and sampling_info)
    committed: torch.Tensor,  # [bs] C: the anchor's position
    padding: torch.Tensor | None = None,  # [bs, W - 1] True: a block's padding, no draft
) -> AcceptOutput:
    """The reference decoder's accept rules on SGLang's per-request sampling parameters,
    after the request's penalties and logit bias (:func:`apply_penalties_per_row`, row
    ``j`` with the drafts before it in its history): exact-match acceptance when every
    request is greedy; under ``--enable-deterministic-inference`` (per-request seeds) the
    longest draft prefix equal to what SGLang's seeded sampler draws at each row's position
    (:func:`seeded_targets`); otherwise speculative rejection sampling with point-mass
    drafts (``q = one-hot(d)``), which accepts ``d`` with probability ``p(d)`` and
    resamples from ``p`` without ``d`` at a rejection, so each emitted token follows the
    request's temperature / top-k / top-p / min-p distribution (a greedy row's ``p`` is
    one-hot, so it stays exact match). A logits tensor is modified in place; a
    :class:`StepLogits` is computed and accepted
    :data:`~diffspec.model_executors.sglang.views.LOGITS_ROWS` rows (whole requests) at a
    time."""
    from diffspec.core.penalties import apply_penalties_per_row, needs_penalties

    if isinstance(logits, StepLogits):  # computed and accepted a chunk of requests at a time
        return _accept_in_chunks(drafts, logits, batch, committed, padding)
    sampling_info = batch.sampling_info
    vocab = logits.shape[-1]
    penalties = [request_penalties(req, vocab) for req in batch.reqs]
    if needs_penalties(penalties):
        apply_penalties_per_row(logits, drafts, [list(req.output_ids) for req in batch.reqs],
                                penalties)
    if padding is not None:  # the accept rules' placeholder past each request's drafts
        drafts = drafts.masked_fill(padding, -1)
    if sampling_info is None or sampling_info.is_all_greedy:
        return greedy_accept(drafts, logits)
    if getattr(sampling_info, "sampling_seed", None) is not None:
        targets = seeded_targets(logits, sampling_info, committed)  # [bs, W]
        one_hot = torch.full_like(logits, float("-inf")).scatter_(-1, targets[..., None], 0.0)
        return greedy_accept(drafts, one_hot)
    greedy = sampling_info.top_ks <= 1  # [bs] SGLang marks greedy requests with top_k = 1
    temperature = torch.where(greedy, 0.0, sampling_info.temperatures.reshape(-1).float())
    min_p = sampling_info.min_ps.float() if sampling_info.need_min_p_sampling else None
    probs = torch.softmax(process_logits(logits, temperature, sampling_info.top_ks,
                                         sampling_info.top_ps.float(), min_p),
                          dim=-1)  # [bs, W, V]
    return rejection_sample_accept(drafts, None, probs)


def seeded_targets(
    logits: torch.Tensor,  # [bs, W, vocab] penalised verify logits
    sampling_info,  # SGLang's SamplingBatchInfo, with sampling_seed (deterministic mode)
    committed: torch.Tensor,  # [bs] C: row j's input token is at position C + j
) -> torch.Tensor:  # [bs, W] int64: the token SGLang's AR sampler draws at each row
    """SGLang's deterministic sampler (``Sampler`` on its pytorch backend, which
    deterministic inference forces) on every verify row: ``softmax(logits / T)``, then
    ``top_k_top_p_min_p_sampling_from_probs_torch`` (or ``sampling_from_probs_torch``
    without top-k / top-p / min-p) with the request's seed and the row's input position,
    exactly as an AR decode step at that position draws; greedy requests take the
    argmax."""
    from sglang.srt.layers.sampler import (
        sampling_from_probs_torch,
        top_k_top_p_min_p_sampling_from_probs_torch,
    )

    bs, w, vocab = logits.shape

    def rows(t: torch.Tensor) -> torch.Tensor:  # [bs] or [bs, 1] -> [bs * W]
        return t.reshape(bs).repeat_interleave(w)

    flat = logits.reshape(bs * w, vocab)
    greedy_ids = flat.argmax(dim=-1)
    positions = (committed.to(torch.int64)[:, None]
                 + torch.arange(w, device=logits.device)[None]).reshape(-1)
    probs = torch.softmax(flat / rows(sampling_info.temperatures.float())[:, None], dim=-1)
    seeds = rows(sampling_info.sampling_seed)
    if (sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling
            or sampling_info.need_min_p_sampling):
        sampled = top_k_top_p_min_p_sampling_from_probs_torch(
            probs, rows(sampling_info.top_ks), rows(sampling_info.top_ps),
            rows(sampling_info.min_ps), sampling_info.need_min_p_sampling, seeds, positions)
    else:
        sampled = sampling_from_probs_torch(probs, sampling_seed=seeds, positions=positions)
    greedy = rows(sampling_info.top_ks) <= 1
    return torch.where(greedy, greedy_ids, sampled.reshape(-1).to(torch.int64)).view(bs, w)


# ------------------------------------------------------------------ logits, a chunk at a time


@dataclass
class StepLogits:
    """The fp32 logits ``[bs, T, vocab]`` of a step's forward, held as its final hidden
    states and computed only for the rows asked, by the model's own logits processor
    (SGLang's ``LogitsProcessor._get_logits``: its LM head, logit scale, soft cap and
    tensor-parallel gather, what the forward would have computed for every row). Callers
    ask for at most :data:`~diffspec.model_executors.sglang.views.LOGITS_ROWS` rows (or one
    request's) at once: issue 29, row 8."""

    model: object  # the served model (its logits_processor, lm_head, config)
    hidden: torch.Tensor  # [bs, T, hidden] final hidden states (after the norm)
    metadata: object  # SGLang's LogitsMetadata of the forward
    whole: torch.Tensor | None = None  # [bs, T, vocab] under DP attention (see step_logits)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.hidden.shape[:2], int(self.model.config.vocab_size))

    def columns(self, index: slice) -> StepLogits:
        """The logits of step columns ``index`` (no copy)."""
        return StepLogits(self.model, self.hidden[:, index], self.metadata,
                          None if self.whole is None else self.whole[:, index])

    def requests(self, index: slice) -> torch.Tensor:  # [r, T, vocab] fp32
        """The logits of requests ``index``, computed now (all their rows at once)."""
        if self.whole is not None:
            return self.whole[index]
        hidden = self.hidden[index]
        return self._logits(hidden.reshape(-1, hidden.shape[-1])).view(
            *hidden.shape[:2], -1)

    def argmax(self, requests: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``argmax`` of the logits at ``[requests, columns]`` (index tensors that broadcast
        to ``[bs, k]``), ``LOGITS_ROWS`` rows at a time: ``[bs, k]``."""
        if self.whole is not None:
            return self.whole[requests, columns].argmax(dim=-1)
        hidden = self.hidden[requests, columns]  # [bs, k, hidden]
        return views.argmax_in_chunks(self._logits, hidden.reshape(-1, hidden.shape[-1])
                                      ).view(hidden.shape[:2])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        vocab = int(self.model.config.vocab_size)
        logits = self.model.logits_processor._get_logits(
            hidden, self.model.lm_head, self.metadata, use_logits_buffer=False)
        return logits[:, :vocab].float()


def step_logits(model, forward: Callable[[], object], bs: int, t: int) -> StepLogits:
    """Run ``forward()``, a forward of ``model`` over ``bs x t`` step tokens, with the
    model's logits processor handing back the final hidden states instead of computing
    every row's logits, and return them as :class:`StepLogits`. Under DP attention the
    processor gathers the rows of every rank in one collective, so there the logits of all
    rows are computed at once, as SGLang does."""
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessorOutput

    processor = model.logits_processor
    seen: dict = {}

    def hidden_only(input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs):
        if isinstance(logits_metadata, ForwardBatch):
            logits_metadata = LogitsMetadata.from_forward_batch(logits_metadata)
        seen["hidden"], seen["metadata"] = hidden_states, logits_metadata
        return LogitsProcessorOutput(next_token_logits=None)

    processor.forward = hidden_only  # an instance attribute: nn.Module calls it
    try:
        forward()
    finally:
        del processor.forward
    logits = StepLogits(model, seen["hidden"].view(bs, t, -1), seen["metadata"])
    if getattr(processor, "do_tensor_parallel_all_gather_dp_attn", False):
        logits.whole = logits.requests(slice(None))
    return logits


_PER_REQUEST = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed")


class _Requests:
    """Requests ``part`` of SGLang's batch (its ``reqs``, and its sampling info's
    per-request tensors; the batch-wide flags, such as ``is_all_greedy``, stay the whole
    batch's, so every part takes the path the whole batch takes)."""

    def __init__(self, whole, part: slice, sampling: bool = False) -> None:
        self._whole, self._part, self._sampling = whole, part, sampling

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._whole, name)
        if not self._sampling and name == "reqs":
            return value[self._part]
        if not self._sampling and name == "sampling_info":
            return None if value is None else _Requests(value, self._part, sampling=True)
        if self._sampling and name in _PER_REQUEST and value is not None:
            return value[self._part]
        return value


def _accept_in_chunks(drafts: torch.Tensor, logits: StepLogits, batch,
                      committed: torch.Tensor, padding: torch.Tensor | None) -> AcceptOutput:
    """:func:`accept` on whole requests at a time, ``LOGITS_ROWS`` verify rows (or one
    request) per part. Every rule is per request (its penalties, its greedy argmax, its
    seeded draws at its positions), so the result equals one call over the batch; unseeded
    sampling draws from the global generator in another order when the batch spans
    several parts (the same distribution)."""
    bs, w, _ = logits.shape
    per = max(1, views.LOGITS_ROWS // max(w, 1))
    if per >= bs:
        return accept(drafts, logits.requests(slice(None)), batch, committed, padding)
    outputs, accepted = [], []
    for start in range(0, bs, per):
        part = slice(start, start + per)
        out = accept(drafts[part], logits.requests(part), _Requests(batch, part),
                     committed[part], None if padding is None else padding[part])
        outputs.append(out.output_token_ids)
        accepted.append(out.num_accepted)
    return AcceptOutput(torch.cat(outputs), torch.cat(accepted))


# ------------------------------------------------------------------- start-up profile

PROFILE_CONTEXT = 256  # context tokens each row of a profile forward attends over


def _dummy_decode_batch(runner, tokens: int, context: int) -> ForwardBatch:
    """A DECODE forward batch of ``tokens`` rows, each at position ``context - 1`` over
    ``context`` keys, built as SGLang builds its own dummy batches (``CPUGraphRunner.
    capture_one_batch_size``, ``BaseRunner._dummy_run``): every row on request-pool row 0
    and KV slot 0, the padding row and slot SGLang reserves so that dummy reads and writes
    land there harmlessly (``ReqToTokenPool``, the KV pools); bound to the runner's KV
    index translator as a runner-built batch (``bind_runner_slots``)."""
    device = runner.device
    lens = torch.full((tokens,), context, dtype=torch.int64, device=device)
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=tokens,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.zeros(tokens, dtype=torch.int64, device=device),
        seq_lens=lens, seq_lens_cpu=lens.cpu(), orig_seq_lens=lens,
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64, device=device),
        seq_lens_sum=tokens * context, return_logprob=False, positions=lens - 1,
        spec_algorithm=runner.spec_algorithm, capture_hidden_mode=CaptureHiddenMode.NULL,
        global_forward_mode=ForwardMode.DECODE)
    runner.kv_index_translator.bind_runner_slots(forward_batch)
    return forward_batch


def measure_profile(runner, server_args, method: str, max_drafts: int,
                    tokens_per_request: int, max_tokens: int | None = None):
    """The latency profile of ``runner``'s own forwards: a DECODE forward of ``T`` rows
    (each over :data:`PROFILE_CONTEXT` keys, or the model's length) with the argmax of the
    logits of all ``T`` (:func:`step_logits`, ``LOGITS_ROWS`` rows at a time), for the
    widths of :func:`~diffspec.profiling.profile_grid` up to the widest step the policy can
    choose (every running request at ``tokens_per_request``; on a backend other than the
    torch-native one, at most one row per request slot, the backend's decode buffers: the
    profile extrapolates past it; never past ``max_tokens``, the most a step of the worker
    runs), within about ``profiling.PROFILE_BUDGET_S``
    seconds. On the torch-native backend (SGLang's CPU path) the two-pass draft and verify
    run exactly such rows. Cached per checkpoint, SGLang and torch versions, dtype,
    quantization, device, threads, tensor parallelism, attention backend, method, drafts
    and grid (:func:`~diffspec.profiling.read_cached_profile`); one log line says which and
    what it cost. Tensor-parallel ranks run the forwards together and take rank 0's
    profile (and its cache decision)."""

    import sglang
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from diffspec.profiling import checkpoint_identity, device_name, engine_profile, profile_grid

    model_config = runner.model_config
    backend = runner.attn_backend
    slots = int(runner.req_to_token_pool.size)  # request slots (row 0, padding, aside)
    widest = slots * tokens_per_request
    if not isinstance(backend, TorchNativeAttnBackend):
        widest = min(widest, slots)
    if max_tokens is not None:
        widest = min(widest, max_tokens)
    context = max(1, min(PROFILE_CONTEXT, int(model_config.context_len) - 1))
    grid = profile_grid(max(1, widest))
    tp = get_tp_group()
    device = torch.device(runner.device)
    key = {
        "engine": "sglang", "engine_version": sglang.__version__, "torch": torch.__version__,
        "checkpoint": checkpoint_identity(server_args.model_path,
                                          model_config.hf_config.to_dict()),
        "dtype": str(model_config.dtype), "quantization": server_args.quantization,
        "device": device_name(device), "threads": torch.get_num_threads(),
        "tensor_parallel": tp.world_size, "attention_backend": type(backend).__name__,
        "method": method, "max_drafts": max_drafts, "grid": grid,
    }

    @torch.inference_mode()
    def forward(tokens: int) -> None:
        forward_batch = _dummy_decode_batch(runner, tokens, context)
        backend.init_forward_metadata(forward_batch)
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            # the logits of all T rows, LOGITS_ROWS at a time (never one [T, vocab] tensor)
            logits = step_logits(runner.model, lambda: runner.model(
                forward_batch.input_ids, forward_batch.positions, forward_batch), tokens, 1)
        rows = torch.arange(tokens, device=device)[:, None]
        logits.argmax(rows, torch.zeros_like(rows))

    return engine_profile(key, forward, grid, device, tp, lambda line: logger.info("%s", line))
