"""SGLang worker for linear self-speculation (Orthrus, NLD): the served model drafts with
its own diffusion view and verifies with its AR view, on SGLang's scheduler and KV pool.

SGLang builds it as ``Worker(server_args=, gpu_id=, nccl_port=, target_worker=)`` for
``--speculative-algorithm ORTHRUS`` / ``LINEAR_SELF_SPEC`` (registered by
:mod:`diffspec.plugin.sglang`) and calls :meth:`SelfSpecWorker.forward_batch_generation`
once per scheduler step, synchronously (overlap scheduling is off for these algorithms).

KV convention (SGLang's): a request's ``seq_len`` ``C`` counts the tokens whose K/V are in
the pool; its last emitted token, the **anchor**, is at position ``C`` and has no K/V yet.

* **prefill** (EXTEND): SGLang's own forward and sampler; the sampled token becomes the
  anchor carried to the next step in :class:`SelfSpecDraftInput`.
* **decode** (one step, ``W = --speculative-num-draft-tokens``, at most the checkpoint's
  ``block_size``): request ``b`` drafts ``n_b = min(W - 1, remaining_b - 1, last position
  - C_b)`` tokens, the reference decoder's rule (never past its ``max_new_tokens``, which
  SGLang caps at the context end, or the model's positions); the step's width is
  ``1 + max n_b`` (SGLang's verify has one width per step) and a narrower block is padded:

  1. *draft*: one diffusion-view forward over each block ``[anchor, <mask> x n_b]`` at
     positions ``C .. C + n_b``, through SGLang's attention backend with each layer's
     non-causal twin (:mod:`diffspec.model_executors.sglang.views`): a forward batch laid
     out as the verify's, so the block attends to the committed prefix's AR K/V in the
     pool and to itself (not to its padding), and its draft K/V land in the slots the
     verify overwrites next; the drafts are the argmax of the ``n_b`` logits that predict
     positions ``C + 1 .. C + n_b``. On SGLang's torch-native backend (the CPU path), whose
     extend kernel attends with a query as long as the whole sequence, both passes run as
     DECODE rows instead, one per block token (:meth:`SelfSpecWorker._decode_rows_batch`):
     the same attention, linear in the context;
  2. *verify*: one causal AR forward of ``[anchor, d_1 .. d_{W-1}]`` by SGLang's model
     runner (TARGET_VERIFY), writing its K/V into the slots ``req_to_token`` maps
     ``C .. C + W - 1`` to: the draft slots the scheduler reserved for this step
     (``alloc_for_spec_decode``);
  3. *accept*: :func:`diffspec.core.accept.greedy_accept` (the reference decoder's rule):
     the longest prefix of the ``n_b`` drafts equal to the AR argmax, plus the AR token
     after it;
  4. *commit*: SGLang's: ``new_seq_len = C + accepted + 1`` (the anchor and the accepted
     drafts now hold AR K/V; the rest of the slots hold rejected K/V past the committed
     length, which SGLang frees and never inserts into the radix cache), the scheduler
     appends the emitted tokens and cuts them at EOS / ``max_new_tokens``, and counts
     ``spec_verify_ct`` / ``spec_num_correct_drafts`` (``avg_spec_accept_length``).

**Adaptive draft counts** (``--json-model-override-args '{"diffspec": {"adaptive": true,
"latency_profile": PATH}}'``, SGLang's channel for model-level settings): each step the
policy of :mod:`diffspec.core.adaptive` picks one draft count ``k`` for the whole batch
(SGLang's verify has one width per step) from the latency profile, the batch size and the
acceptance it has observed; the step then runs at width ``k + 1`` (``k = 0``: no draft
forward, SGLang's own decode forward, i.e. a plain AR step). The choices are logged every
100 steps and counted in Prometheus counters (:class:`ChoiceMetrics`). Greedy output is
AR's whatever it picks.

Drafts are argmaxes of the diffusion view (point masses). Per request, the verify rows
first get the request's repetition / presence / frequency penalties, ``min_new_tokens``
and logit bias with the history AR would have at each row (its output plus the drafts
before the row: :mod:`diffspec.core.penalties`). Greedy requests are then accepted by
exact match, so their output is SGLang's AR output token for token; sampled requests
(temperature / top-k / top-p / min-p) by speculative rejection sampling, so their output
follows the AR distribution (not SGLang's sampler's random stream); with
``--enable-deterministic-inference`` (SGLang's only mode that honours per-request
``sampling_seed``) each row's token is drawn by SGLang's own seeded sampler at the row's
position, so seeded output is SGLang's AR output token for token (GPU attention backends
only: SGLang refuses deterministic inference on torch-native; not run here). Refused per
request (aborted with a message, the rest of the batch runs on): ``return_logprob``,
grammars (``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``) and custom logit
processors.
Stop strings, stop tokens and ``max_new_tokens`` are the scheduler's own checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from diffspec.core.accept import AcceptOutput, greedy_accept, rejection_sample_accept
from diffspec.core.sampling import process_logits
from diffspec.model_executors.sglang.views import DraftBlocks
from diffspec.profiling import DraftTimings

__all__ = ["SelfSpecDraftInput", "SelfSpecWorker", "TargetModelSpecWorker"]

logger = logging.getLogger("diffspec")


@dataclass
class SelfSpecDraftInput(SpecInput):
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

    def merge_batch(self, other: SelfSpecDraftInput) -> None:
        if not isinstance(other, SelfSpecDraftInput):
            raise TypeError(f"cannot merge SelfSpecDraftInput with {type(other).__name__}")
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

    @property
    def draft_worker(self):
        return None  # every pass runs the target model on the target KV pool

    def clear_cache_pool(self) -> None:
        pass  # no private state outside SGLang's pools

    def __getattr__(self, name: str):
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    # ---------------------------------------------------------------------- scheduler API

    def forward_batch_generation(
        self, batch, on_publish=None, **_: object
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_extend() and not batch.forward_mode.is_target_verify():
            refuse_unsupported_requests(batch, self.method)
            return self._prefill(batch, on_publish)
        if batch.forward_mode.is_decode():
            refuse_unsupported_requests(batch, self.method)  # (all were, at their prefill)
            return self._decode(batch, on_publish)
        raise RuntimeError(f"{self.method}: unexpected batch mode {batch.forward_mode} "
                           f"(idle and mixed batches are not supported)")

    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        raise NotImplementedError

    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        raise NotImplementedError


class SelfSpecWorker(TargetModelSpecWorker):
    """Draft with the served model's diffusion view, verify with its AR view."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        model = self.model_runner.model
        if not hasattr(model, "diffusion_draft_logits"):
            raise TypeError(
                f"--speculative-algorithm {self.method.upper()} needs a model with a diffusion "
                f"view; {type(model).__name__} has none (check config.json architectures)")
        self.mask_token_id = int(model.config.mask_token_id)
        max_len = getattr(model.config, "max_position_embeddings", None)
        self._max_position = int(max_len or self.model_runner.model_config.context_len) - 1
        self._offsets = torch.arange(self.width, device=self.device)  # [W]
        self.adaptive = adaptive_policy(self.model_runner.model_config.hf_config,
                                        self.width - 1, "two_pass", self.method)
        self.timings = DraftTimings(self.device)

    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        result = self._target_worker.forward_batch_generation(batch)
        result.next_draft_input = SelfSpecDraftInput(
            bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
            new_seq_lens=batch.seq_lens)
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    @torch.inference_mode()
    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        state: SelfSpecDraftInput = batch.spec_info
        bs = len(batch.reqs)
        rids = [req.rid for req in batch.reqs]
        committed = batch.seq_lens.to(torch.int64)  # [bs] C
        # drafts per request, as the reference decoder: never past the request's budget
        # (accepted + 1 <= remaining; SGLang caps max_new_tokens at the context end) or
        # the model's positions (the anchor is at C)
        caps = [max(0, min(self.width - 1, _remaining(req) - 1, self._max_position - c))
                for req, c in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True)]
        if self.adaptive is not None:  # one width per step: W = the policy's k + 1
            self.adaptive.forget(set(rids))
            k = self.adaptive.choose_shared(rids, caps)
            choice_metrics().record(k, bs)
            if self.adaptive.steps % self.adaptive.log_every == 1:
                logger.info("diffspec: %s", self.adaptive.summary())
            caps = [min(k, cap) for cap in caps]
        w = 1 + max(caps)  # one width per step (SGLang's verify); narrower blocks padded
        num_drafts = torch.tensor(caps, dtype=torch.int64, device=self.device)  # [bs]
        anchors = state.bonus_tokens.reshape(-1).to(torch.int64)  # [bs]
        columns = committed[:, None] + self._offsets[None, :w]  # [bs, W]
        rows = batch.req_pool_indices.to(torch.int64)  # [bs]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token  # [reqs, ctx]
        slots = req_to_token[rows[:, None], columns].to(torch.int64)  # [bs, W]
        # a padded row may sit past the model's last position (never committed); RoPE
        # needs positions it has
        positions = columns.clamp(max=self._max_position)  # [bs, W]

        # draft: the diffusion view over each request's [anchor, <mask> x n] (n = its
        # draft count; the block's padding rows are invisible to it) (W = 1: nothing is
        # drafted this step, a plain AR step)
        if w > 1:
            drafts = self.timings.time(bs * w, lambda: self._draft(
                batch, anchors, positions, slots, num_drafts))  # [bs, W - 1]
        else:
            drafts = anchors.new_zeros((bs, 0))
        padding = self._offsets[None, : w - 1] >= num_drafts[:, None]  # [bs, W - 1]

        # verify: SGLang's causal forward of [anchor, drafts] into the reserved slots
        verify_ids = torch.cat([anchors[:, None], drafts], dim=1)  # [bs, W]
        logits = (self._verify(batch, verify_ids, positions, slots) if w == 1  # [bs, W, vocab]
                  else self.timings.time(bs * w, lambda: self._verify(
                      batch, verify_ids, positions, slots), kind="verify"))

        # accept: greedy rows take the longest prefix equal to the AR argmax, then the AR
        # token after it; sampled rows rejection-sample the point-mass drafts
        accepted = _accept(drafts, logits, batch, committed, padding)
        accept_lens = accepted.num_emitted.to(torch.int32)  # [bs] accepted + 1
        out = accepted.output_token_ids  # [bs, W]: emitted tokens, then -1
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)
        bonus = out.gather(1, accepted.num_accepted[:, None]).reshape(-1)  # [bs] next anchor
        if self.adaptive is not None:
            for rid, emitted in zip(rids, accept_lens.tolist(), strict=True):
                self.adaptive.observe(rid, emitted)
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=out.clamp(min=0).reshape(-1),
            accept_lens=accept_lens,
            new_seq_lens=new_seq_lens,
            next_draft_input=SelfSpecDraftInput(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=w,
            speculative_output_stride=w,
            num_non_draft_tokens_per_req=1,
        )

    def _draft(
        self,
        batch,
        anchors: torch.Tensor,  # [bs] the committed tokens the blocks start from
        positions: torch.Tensor,  # [bs, W]
        slots: torch.Tensor,  # [bs, W] KV-pool slots of positions C .. C + W - 1
        num_drafts: torch.Tensor,  # [bs] n: block b is [anchor, <mask> x n], then padding
    ) -> torch.Tensor:  # [bs, W - 1] greedy drafts (padding rows: not drafts)
        """The diffusion view over ``[anchor, <mask> x (W - 1)]`` through SGLang's attention
        backend: a forward batch laid out as this step's verify (same positions, same
        slots: the verify overwrites the draft K/V the backend writes there), its metadata
        planned by the backend, the layers' non-causal attention twins reading the pool."""
        bs, w = positions.shape
        block = torch.full((bs, w), self.mask_token_id, dtype=torch.int64, device=self.device)
        block[:, 0] = anchors
        forward_batch = self._step_batch(batch, block, positions, slots, causal=False,
                                         block_lens=num_drafts + 1)
        draft_logits = self._run_model(forward_batch, lambda: (
            self.model_runner.model.diffusion_draft_logits(DraftBlocks(
                block.reshape(-1), positions.reshape(-1), w, forward_batch))))  # [bs, W-1, V]
        return draft_logits.argmax(dim=-1)

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

    def _step_batch(
        self,
        batch,
        ids: torch.Tensor,  # [bs, W]
        positions: torch.Tensor,  # [bs, W]
        slots: torch.Tensor,  # [bs, W]
        causal: bool = True,
        block_lens: torch.Tensor | None = None,  # [bs] non-causal: block tokens seen
    ) -> ForwardBatch:
        """SGLang's TARGET_VERIFY forward batch of ``ids`` at ``positions`` (``W`` tokens per
        request on its committed prefix), K/V going to ``slots``, with SGLang's own verify
        input (``NgramVerifyInput``, what its GPU backends plan target-verify batches
        from): a chain, causal within the block (the verify), or the whole block visible to
        every block token (``causal=False``, the draft); the GPU backends read the mask. On
        the torch-native backend the same attention runs as decode rows
        (:meth:`_decode_rows_batch`)."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        w = ids.shape[1]
        if block_lens is None:
            block_lens = torch.full((ids.shape[0],), w, dtype=torch.int64, device=self.device)
        if self._torch_native:
            return self._decode_rows_batch(batch, ids, positions, slots, causal, block_lens)
        # per request [W, C + W] (prefix, then the block: a chain, or its first block_len
        # tokens for every row), flat
        chain = torch.ones(w, w, dtype=torch.bool, device=self.device).tril()
        seen = self._offsets[None, :w] < block_lens[:, None]  # [bs, W] block columns seen
        mask = torch.cat([torch.cat([torch.ones(w, c, dtype=torch.bool, device=self.device),
                                     chain if causal else seen[b][None, :].expand(w, w)],
                                    dim=1).reshape(-1)
                          for b, c in enumerate(batch.seq_lens_cpu.tolist())])
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = ids.reshape(-1)
        batch.out_cache_loc = slots.reshape(-1)
        batch.spec_info = NgramVerifyInput(custom_mask=mask, positions=positions.reshape(-1),
                                           draft_token_num=w, new_seq_lens=batch.seq_lens)
        try:
            return ForwardBatch.init_new(batch, self.model_runner,
                                         return_hidden_states_before_norm=False)
        finally:
            batch.forward_mode = ForwardMode.DECODE

    def _decode_rows_batch(
        self,
        batch,
        ids: torch.Tensor,  # [bs, W]
        positions: torch.Tensor,  # [bs, W]
        slots: torch.Tensor,  # [bs, W]
        causal: bool,
        block_lens: torch.Tensor,  # [bs] non-causal: the block tokens every row sees
    ) -> ForwardBatch:
        """The step's ``bs * W`` block tokens as SGLang DECODE rows, for the torch-native
        backend: its extend kernel (what a TARGET_VERIFY runs) attends with a query as long
        as the whole sequence per request, quadratic in the context, while its decode
        kernel attends from one query over ``seq_len`` keys of ``req_to_token``. Row
        ``(b, j)`` is request ``b``'s block token ``j`` at its position, writing its K/V to
        its slot (every row's K/V is written before any row attends), over the request's
        first ``C + j + 1`` keys (``causal``: the verify's chain) or ``C + block_len``
        (the draft's block, without its padding rows). Same attention as the TARGET_VERIFY layout, linear in the
        context; the batch's own fields are restored."""
        w = ids.shape[1]
        committed = batch.seq_lens.to(torch.int64)  # [bs] C
        reach = (self._offsets[None, :w] + 1 if causal
                 else block_lens[:, None].expand(-1, w))  # [bs, W] block tokens seen
        row_lens = (committed[:, None] + reach).reshape(-1)  # [bs * W]
        saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info,
                 batch.req_pool_indices, batch.input_ids, batch.out_cache_loc)
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = None  # a decode with spec_info reads as a draft decode
        batch.input_ids = ids.reshape(-1)
        batch.out_cache_loc = slots.reshape(-1)
        batch.req_pool_indices = saved[4].repeat_interleave(w)
        batch.seq_lens = row_lens.to(saved[0].dtype)
        batch.seq_lens_cpu = batch.seq_lens.cpu()
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        try:
            forward_batch = ForwardBatch.init_new(batch, self.model_runner,
                                                  return_hidden_states_before_norm=False)
        finally:
            (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info,
             batch.req_pool_indices, batch.input_ids, batch.out_cache_loc) = saved
        forward_batch.positions = positions.reshape(-1).to(forward_batch.positions.dtype)
        return forward_batch

    @property
    def _torch_native(self) -> bool:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return isinstance(self.model_runner.attn_backend, TorchNativeAttnBackend)

    def _verify(
        self,
        batch,
        verify_ids: torch.Tensor,  # [bs, W]
        positions: torch.Tensor,  # [bs, W]
        slots: torch.Tensor,  # [bs, W] KV-pool slots of positions C .. C + W - 1
    ) -> torch.Tensor:  # [bs, W, vocab] fp32 logits
        bs, w = verify_ids.shape
        if w == 1:  # nothing drafted this step (adaptive k = 0): a plain decode step
            return self._decode_forward(batch, verify_ids[:, 0], slots[:, 0])
        forward_batch = self._step_batch(batch, verify_ids, positions, slots)
        if self._torch_native:  # decode rows: more rows than the runner's decode buffers
            logits = self._run_model(forward_batch).next_token_logits  # [bs * W, vocab']
        else:
            result = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True)
            logits = result.logits_output.next_token_logits  # [bs * W, padded vocab]
        vocab = self.model_runner.model.config.vocab_size
        return logits[:, :vocab].float().view(bs, w, vocab)


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


def _remaining(req) -> int:
    """Tokens ``req`` may still emit (``max_new_tokens``, which SGLang caps at the context
    end, minus its output so far)."""
    return int(req.sampling_params.max_new_tokens) - len(req.output_ids)


def adaptive_policy(hf_config, max_drafts: int, cost: str, method: str = "orthrus"):
    """The adaptive draft-count policy, when the model config carries ``diffspec:
    {"adaptive": true, "latency_profile": PATH}`` (SGLang's ``--json-model-override-args``;
    SGLang has no flag of ours), else ``None``."""
    import json
    from pathlib import Path

    from diffspec.core.adaptive import AdaptiveDrafts, StepCost, load_latency_profile

    options = getattr(hf_config, "diffspec", None) or {}
    if not isinstance(options, dict) or not options.get("adaptive"):
        return None
    path = options.get("latency_profile")
    if not path:
        raise ValueError("add \"latency_profile\": PATH next to \"adaptive\": true in "
                         "--json-model-override-args '{\"diffspec\": {...}}': the adaptive "
                         "policy needs a latency profile (python -m benchmarks.adaptive_sweep "
                         f"--profile-only --engines sglang --model CKPT --method {method} "
                         "--out DIR measures one through SGLang: "
                         "DIR/sglang-latency-profile.json)")
    try:
        profile = load_latency_profile(json.loads(Path(path).expanduser().read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"latency_profile {path!r} cannot be read as a forward-latency "
                         f"profile: {exc}") from exc
    logger.info("diffspec: adaptive draft counts (at most %d per step) from the latency "
                "profile %s", max_drafts, path)
    return AdaptiveDrafts(max_drafts, profile, StepCost(cost))


class ChoiceMetrics:
    """The adaptive policy's choices as Prometheus counters (``prometheus_client``, which
    SGLang uses): ``diffspec:adaptive_steps_total{drafts="k"}``, decode steps by the draft
    count chosen for the step, and ``diffspec:adaptive_draft_tokens_total``, draft tokens
    chosen (k times the batch). With ``--enable-metrics`` SGLang puts prometheus_client in
    multiprocess mode before its scheduler starts, so they show in its ``/metrics`` next to
    its own. (SGLang's own ``spec_num_proposed_drafts`` counts ``W - 1`` per verify step,
    the server's width, whatever a step drafted.)"""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.steps = Counter("diffspec:adaptive_steps", "Decode steps of diffspec's adaptive "
                             "self-speculation, by the draft count chosen for the step",
                             ["drafts"])
        self.draft_tokens = Counter("diffspec:adaptive_draft_tokens", "Draft tokens "
                                    "diffspec's adaptive policy chose (over requests and steps)")

    def record(self, drafts: int, batch_size: int) -> None:
        self.steps.labels(drafts=str(drafts)).inc()
        self.draft_tokens.inc(drafts * batch_size)


_CHOICE_METRICS: list[ChoiceMetrics] = []


def choice_metrics() -> ChoiceMetrics:
    """The process's one :class:`ChoiceMetrics` (Prometheus refuses a metric registered
    twice)."""
    if not _CHOICE_METRICS:
        _CHOICE_METRICS.append(ChoiceMetrics())
    return _CHOICE_METRICS[0]


def unsupported_request_option(req) -> str | None:
    """What of ``req`` (an SGLang ``Req``) the self-speculative workers cannot honour, as
    the start of an error message, or ``None``."""
    params = req.sampling_params
    if req.return_logprob:
        return "drop return_logprob (or serve without --speculative-algorithm)"
    if getattr(req, "grammar", None) is not None or any(
            getattr(params, name, None) is not None
            for name in ("json_schema", "regex", "ebnf", "structural_tag")):
        return "drop json_schema / regex / ebnf / structural_tag (or serve without " \
               "--speculative-algorithm)"
    if getattr(req, "custom_logit_processor", None):
        return "drop custom_logit_processor (or serve without --speculative-algorithm)"
    return None


def refuse_unsupported_requests(batch, method: str) -> list:
    """Abort, one by one, the requests of ``batch`` with an option the worker cannot honour
    (SGLang's ``Req.to_finish``: the request finishes after this step with an ``abort``
    finish reason, HTTP 400, and this message; the other requests of the batch run on).
    As SGLang's ``Req.set_finish_with_abort`` does, a refused request computes no
    logprobs. Returns the requests refused now."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    refused = []
    for req in batch.reqs:
        if req.finished() or req.to_finish is not None:
            continue
        what = unsupported_request_option(req)
        if what is None:
            continue
        message = (f"{what[0].upper()}{what[1:]}: --speculative-algorithm {method.upper()} "
                   f"does not support it")
        logger.warning("diffspec: refusing request %s: %s", req.rid, message)
        req.to_finish = FINISH_ABORT(message, status_code=HTTPStatus.BAD_REQUEST,
                                     err_type="BadRequestError")
        req.return_logprob = False
        req.logprob_start_len = -1
        refused.append(req)
    if refused and batch.return_logprob:
        batch.return_logprob = any(req.return_logprob for req in batch.reqs)
    return refused


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


def _accept(
    drafts: torch.Tensor,  # [bs, W - 1] draft token ids
    logits: torch.Tensor,  # [bs, W, vocab] AR logits of [anchor, drafts] (modified in place)
    batch,  # SGLang's ScheduleBatch (its reqs and sampling_info)
    committed: torch.Tensor,  # [bs] C: the anchor's position
    padding: torch.Tensor | None = None,  # [bs, W - 1] True: a block's padding, no draft
) -> AcceptOutput:
    """The reference decoder's accept rules on SGLang's per-request sampling parameters,
    after the request's penalties and logit bias (:func:`apply_penalties_per_row`, row
    ``j`` with the drafts before it in its history): exact-match acceptance when every
    request is greedy; under ``--enable-deterministic-inference`` (per-request seeds) the
    longest draft prefix equal to what SGLang's seeded sampler draws at each row's position
    (:func:`_seeded_targets`); otherwise speculative rejection sampling with point-mass
    drafts (``q = one-hot(d)``), which accepts ``d`` with probability ``p(d)`` and
    resamples from ``p`` without ``d`` at a rejection, so each emitted token follows the
    request's temperature / top-k / top-p / min-p distribution (a greedy row's ``p`` is
    one-hot, so it stays exact match)."""
    from diffspec.core.penalties import apply_penalties_per_row, needs_penalties

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
        targets = _seeded_targets(logits, sampling_info, committed)  # [bs, W]
        one_hot = torch.full_like(logits, float("-inf")).scatter_(-1, targets[..., None], 0.0)
        return greedy_accept(drafts, one_hot)
    greedy = sampling_info.top_ks <= 1  # [bs] SGLang marks greedy requests with top_k = 1
    temperature = torch.where(greedy, 0.0, sampling_info.temperatures.reshape(-1).float())
    min_p = sampling_info.min_ps.float() if sampling_info.need_min_p_sampling else None
    probs = torch.softmax(process_logits(logits, temperature, sampling_info.top_ks,
                                         sampling_info.top_ps.float(), min_p),
                          dim=-1)  # [bs, W, V]
    return rejection_sample_accept(drafts, None, probs)


def _seeded_targets(
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
