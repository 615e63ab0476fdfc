"""SGLang worker for TiDAR / NLD quadratic self-speculation: the served model drafts and
verifies in ONE forward per step, on SGLang's model runner, layers and KV pool.

Design notes: docs/design/sglang.md (section ``diffspec/spec_workers/sglang/tidar.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from diffspec.core.adaptive import StepCost, choose_shared_draft_count
from diffspec.core.checkpoint import inspect_checkpoint, require_method
from diffspec.model_executors.sglang.quadratic import (
    MaskedAttention,
    MaskedLayout,
    branch_size,
    decode_step_rows,
    draft_rows,
    fit_drafts,
    prefill_branch_layout,
    prefill_rows,
    verify_step_layout,
)
from diffspec.model_executors.sglang.views import argmax_in_chunks
from diffspec.plugin.sglang.config import activation_tokens
from diffspec.profiling import DraftTimings
from diffspec.spec_workers.sglang.target_worker import (
    SpecDraftInput,
    StepLogits,
    TargetModelSpecWorker,
    accept,
    choice_metrics,
    step_logits,
)

__all__ = ["TiDARDraftInput", "TiDARWorker"]

logger = logging.getLogger("diffspec")


@dataclass
class TiDARDraftInput(SpecDraftInput):
    """The linear worker's carried state (anchor, committed length) plus the anchor's
    drafts, pre-drafted by the last step's accepted branch."""

    drafts: torch.Tensor | None = None  # [bs, n]

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu=None) -> None:
        super().filter_batch(new_indices, new_indices_cpu)
        self.drafts = self.drafts[new_indices]

    def merge_batch(self, other: TiDARDraftInput) -> None:
        """Concatenate the batches; with adaptive draft counts they may carry different
        numbers of drafts: each keeps the first ``n`` (the fewest either carries)."""
        if not isinstance(other, TiDARDraftInput):
            raise TypeError(f"cannot merge TiDARDraftInput with {type(other).__name__}")
        super().merge_batch(other)
        n = min(self.drafts.shape[1], other.drafts.shape[1])
        self.drafts = torch.cat([self.drafts[:, :n], other.drafts[:, :n]])


@dataclass(frozen=True)
class _StepLayout:
    """A decode step that verifies ``n`` drafts and pre-drafts ``k`` per request."""

    new_mask: torch.Tensor  # [T, T] among the step's tokens; T = (n + 1)(1 + K')
    offsets: torch.Tensor  # [T] positions minus C
    draft_rows: torch.Tensor  # [n + 1, k] rows of outcome a's next drafts


class TiDARWorker(TargetModelSpecWorker):
    """Draft and verify with the served model in one quadratic forward per step."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        info = inspect_checkpoint(server_args.model_path)
        require_method(info, "tidar")
        self.mask_token_id = int(info.mask_token_id)
        self.logits_shift = bool(info.logits_shift)
        self.num_drafts = self.width - 1  # n: the most drafts a step verifies
        self.num_masks = branch_size(self.num_drafts, self.logits_shift)  # K'
        self.tokens_per_req = (self.num_drafts + 1) * (1 + self.num_masks)  # T
        self._layouts: dict[tuple[int, int], _StepLayout] = {}  # (n, k) -> layout
        config = self.model_runner.model.config
        self.adaptive = self._adaptive_policy(self.num_drafts, "quadratic")
        if self.adaptive is not None:
            self.adaptive.cost = StepCost("quadratic", skip=0 if self.logits_shift else 1)
        self.timings = DraftTimings(self.device)
        # no forward runs more tokens than SGLang's memory accounting is sized for (its
        # activation reserve, per token of its largest planned forward): a step that would
        # run more pre-drafts fewer (docs/gpu-support.md, memory)
        self.max_step_tokens = activation_tokens(server_args)
        self._capped_logged = False
        # positions past the model's range (branches near its end) are clamped to its last
        max_len = getattr(config, "max_position_embeddings", None)
        self._max_position = int(max_len or self.model_runner.model_config.context_len) - 1
        self._vocab = int(config.vocab_size)
        logger.info("diffspec TIDAR: %d drafts per step, branches of %d masks (%s logits), "
                    "%d tokens per request and step; at most %d tokens per forward (SGLang's "
                    "activation budget)", self.num_drafts, self.num_masks,
                    "shifted" if self.logits_shift else "unshifted", self.tokens_per_req,
                    self.max_step_tokens)

    def _within_budget(self, k: int, rows) -> int:
        """``k`` drafts, or fewer when the step's ``rows(k)`` would exceed
        :attr:`max_step_tokens` (logged the first time)."""
        fitted = fit_drafts(k, self.max_step_tokens, rows)
        if fitted < k and not self._capped_logged:
            self._capped_logged = True
            logger.info("diffspec TIDAR: a step pre-drafts %d instead of %d to stay within "
                        "%d tokens per forward, what SGLang's memory accounting is sized for "
                        "(max(--chunked-prefill-size, 2048)); raise --chunked-prefill-size "
                        "or lower --max-running-requests for full branches", fitted, k,
                        self.max_step_tokens)
        return fitted

    @property
    def profile_tokens_per_request(self) -> int:
        return self.tokens_per_req  # a step's tokens per request at the most drafts

    @property
    def profile_max_tokens(self) -> int:
        return self.max_step_tokens  # no step runs more (_within_budget)

    # ---------------------------------------------------------------------------- prefill

    def _layout(self, n: int, k: int) -> _StepLayout:
        """The decode step that verifies ``n`` drafts and pre-drafts ``k`` (cached)."""
        if (n, k) not in self._layouts:
            masks = branch_size(k, self.logits_shift) if k else 0
            new_mask, offsets = verify_step_layout(n, masks, self.device)
            rows = (draft_rows(n, masks, self.logits_shift, k).to(self.device) if k
                    else torch.zeros(n + 1, 0, dtype=torch.long, device=self.device))
            self._layouts[(n, k)] = _StepLayout(new_mask, offsets, rows)
        return self._layouts[(n, k)]

    def _choose(self, batch, record: bool) -> int:
        """Drafts to pre-draft this step: the policy's shared count (``record``: a decode
        step, counted in the metrics and the log), else the server's."""
        if self.adaptive is None:
            return self.num_drafts
        self.measure_latency_profile()  # done at start-up, unless SGLang skipped the hook
        rids = [req.rid for req in batch.reqs]
        limits = [self.num_drafts] * len(rids)
        if not record:  # the prefill's branch: no decode step to count
            return choose_shared_draft_count([self.adaptive.estimate.conditional] * len(rids),
                                             limits, self.adaptive.profile, self.adaptive.cost)
        self.adaptive.forget(set(rids))
        k = self.adaptive.choose_shared(rids, limits)
        choice_metrics().record(k, len(rids))
        if self.adaptive.steps % self.adaptive.log_every == 1:
            logger.info("diffspec: %s", self.adaptive.summary())
        return k

    @torch.inference_mode()
    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        self.timings.step([req.rid for req in batch.reqs], [], [])  # no steady step
        bs = len(batch.reqs)
        num_prompt = sum(int(x) for x in batch.extend_lens)  # prompt tokens in this forward
        n = self._within_budget(self._choose(batch, record=False), lambda k: prefill_rows(
            num_prompt, bs, k, self.logits_shift))
        if n == 0:  # nothing to pre-draft: SGLang's own prefill
            result = self._target_worker.forward_batch_generation(batch)
            bonus = result.next_token_ids.reshape(-1).to(torch.int64)
            return self._prefilled(result, batch, TiDARDraftInput(
                bonus_tokens=bonus, drafts=bonus.new_zeros((bonus.numel(), 0)),
                new_seq_lens=batch.seq_lens), on_publish)
        k = branch_size(n, self.logits_shift)
        prefix_lens = [int(x) for x in batch.prefix_lens]  # cached prompt tokens
        extend_lens = [int(x) for x in batch.extend_lens]  # prompt tokens in this forward
        masks = torch.full((bs * k,), self.mask_token_id, dtype=batch.input_ids.dtype,
                           device=self.device)
        # the masks' K/V are written to the pool's padding slot 0 (dummy writes)
        dummy = torch.zeros(bs * k, dtype=batch.out_cache_loc.dtype, device=self.device)
        saved = batch.input_ids, batch.out_cache_loc
        batch.input_ids = torch.cat([batch.input_ids, masks])  # [E + bs * K']
        batch.out_cache_loc = torch.cat([batch.out_cache_loc, dummy])
        try:
            forward_batch = ForwardBatch.init_new(
                batch, self.model_runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                return_hidden_states_before_norm=False)
        finally:
            batch.input_ids, batch.out_cache_loc = saved

        # layout: request b's prompt rows, then its K' mask rows at the end of the forward
        req_to_token = self.model_runner.req_to_token_pool.req_to_token  # [reqs, ctx]
        rows, slots, masks_b, mask_positions = [], [], [], []
        start = 0
        for b, (row, prefix, ext) in enumerate(zip(batch.req_pool_indices.tolist(),
                                                   prefix_lens, extend_lens)):
            mask, positions = prefill_branch_layout(prefix, ext, k, self.device)
            rows.append(torch.cat([
                torch.arange(start, start + ext, device=self.device),
                torch.arange(num_prompt + b * k, num_prompt + (b + 1) * k, device=self.device)]))
            slots.append(req_to_token[row, :prefix].to(torch.int64))
            masks_b.append(mask)  # [E_b + K', prefix_b + E_b + K']
            mask_positions.append(positions[ext:])  # [K'] L_b .. L_b + K' - 1
            start += ext
        positions = forward_batch.positions
        forward_batch.positions = torch.cat([
            positions, torch.cat(mask_positions).clamp(max=self._max_position).to(positions.dtype)])
        layout = MaskedLayout(rows, slots, masks_b)

        attention = MaskedAttention(self.model_runner.attn_backend, layout)
        with forward_context(ForwardContext(attn_backend=attention)):
            result = self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch)
        hidden = result.logits_output.hidden_states  # [E + bs * K', hidden]
        result.logits_output.hidden_states = None
        branch = hidden[num_prompt:].view(bs, k, -1)  # [bs, K', hidden] branch 0
        skip = 0 if self.logits_shift else 1
        rows = branch[:, skip: skip + n]  # [bs, n, hidden]
        drafts = argmax_in_chunks(self._logits, rows.reshape(-1, rows.shape[-1])).view(bs, n)

        return self._prefilled(result, batch, TiDARDraftInput(
            bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
            drafts=drafts, new_seq_lens=batch.seq_lens), on_publish)

    # ----------------------------------------------------------------------------- decode

    @torch.inference_mode()
    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        state: TiDARDraftInput = batch.spec_info
        bs = len(batch.reqs)
        committed = batch.seq_lens.to(torch.int64)  # [bs] C
        anchors = state.bonus_tokens.reshape(-1).to(torch.int64)  # [bs]
        drafts = state.drafts.to(torch.int64)  # [bs, n] pre-drafted by the last step
        n = drafts.shape[1]
        k = self._within_budget(  # drafts to pre-draft for the next step
            self._choose(batch, record=True),
            lambda k: decode_step_rows(bs, n, k, self.logits_shift))
        self.timings.step([req.rid for req in batch.reqs], [n] * bs, [k] * bs)
        layout = self._layout(n, k)
        t, w = layout.offsets.numel(), n + 1  # T = (n + 1)(1 + K'); the verify width

        start = self.timings.start() if t > 1 else None  # a quadratic step: timed
        if t == 1:  # nothing to verify, nothing to pre-draft: a plain AR step
            slots = self._step_slots(batch, committed, n, t)  # [bs, 1]
            logits = self._decode_forward(batch, anchors, slots[:, 0])
        else:  # [anchor, d_1 .. d_n, branch 0 .. branch n of K' masks]
            masks = torch.full((bs, t - n - 1), self.mask_token_id, dtype=torch.int64,
                               device=self.device)
            input_ids = torch.cat([anchors[:, None], drafts, masks], dim=1)  # [bs, T]
            positions = committed[:, None] + layout.offsets[None]  # [bs, T]
            slots = self._step_slots(batch, committed, n, t)  # [bs, T]
            logits = self._forward_step(batch, input_ids, positions, slots, committed,
                                        layout.new_mask)  # [bs, T, vocab]

        # accept on the verify rows (the AR logits of [anchor, d_1 .. d_n]); a quadratic
        # step's logits are computed for these rows and the next drafts' only, in chunks
        verify = (logits.columns(slice(0, n + 1)) if isinstance(logits, StepLogits)
                  else logits[:, : n + 1])
        accepted = accept(drafts, verify, batch, committed)
        accept_lens = accepted.num_emitted.to(torch.int32)  # [bs] accepted + 1
        out = accepted.output_token_ids  # [bs, n + 1]: emitted tokens, then -1
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)
        bonus = out.gather(1, accepted.num_accepted[:, None]).reshape(-1)  # [bs] next anchor
        if self.adaptive is not None and n > 0:
            for a in accepted.num_accepted.tolist():
                self.adaptive.estimate.update(n, a)

        # next drafts: branch a pre-drafted exactly this outcome
        branch_rows = layout.draft_rows[accepted.num_accepted]  # [bs, k]
        batch_index = torch.arange(bs, device=self.device)[:, None]  # [bs, 1]
        next_drafts = (logits.argmax(batch_index, branch_rows) if k  # [bs, k]
                       else drafts.new_zeros((bs, 0)))
        self.timings.stop(start, bs * t, kind="verify")

        return self._decoded(out, accept_lens, new_seq_lens, TiDARDraftInput(
            bonus_tokens=bonus, drafts=next_drafts, new_seq_lens=new_seq_lens), w, on_publish)

    def _step_slots(self, batch, committed: torch.Tensor, n: int,
                    t: int) -> torch.Tensor:  # [bs, T]
        """KV-pool slots the step's tokens write to. The verify tokens: the slots
        ``req_to_token`` maps their positions ``C .. C + n`` to (the window SGLang reserved
        past the committed length). The branch tokens: on the torch-native path the
        pool's padding slot 0 (dummy writes; :class:`MaskedAttention` reads the step's K/V
        from the forward itself), on the GPU backends the rest of the window, columns
        ``C + n + 1 .. C + T - 1`` (their kernels read the step's K/V from the pool)."""
        from sglang.srt.runtime_context import max_speculative_num_draft_tokens

        bs = committed.numel()
        window = n + 1 if self._torch_native else t
        reserved = max_speculative_num_draft_tokens() or 0
        if reserved < window:
            raise RuntimeError(
                f"TIDAR: SGLang reserves {reserved} KV slots per request and step, the step "
                f"writes {window} ({type(self.model_runner.attn_backend).__name__}); the "
                f"--attention-backend seen at launch differs from the one running")
        rows = batch.req_pool_indices.to(torch.int64)  # [bs]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token  # [reqs, ctx]
        columns = committed[:, None] + torch.arange(window, device=self.device)[None]
        slots = req_to_token[rows[:, None], columns].to(torch.int64)  # [bs, window]
        if window < t:
            slots = torch.cat([slots, slots.new_zeros(bs, t - window)], dim=1)
        return slots

    def _forward_step(
        self,
        batch,
        input_ids: torch.Tensor,  # [bs, T]
        positions: torch.Tensor,  # [bs, T]
        slots: torch.Tensor,  # [bs, T] KV-pool slots the step writes (_step_slots)
        committed: torch.Tensor,  # [bs] C
        new_mask: torch.Tensor,  # [T, T] among the step's tokens (verify_step_layout)
    ) -> StepLogits:  # [bs, T, vocab] fp32 logits, computed when asked
        bs, t = input_ids.shape
        positions = positions.clamp(max=self._max_position)
        state = batch.spec_info
        custom_mask = None
        if not self._torch_native:  # SGLang's layout: per request [T, C + T], flattened
            custom_mask = torch.cat([
                torch.cat([torch.ones(t, c, dtype=torch.bool, device=self.device),
                           new_mask], dim=1).reshape(-1)
                for c in committed.tolist()])
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = input_ids.reshape(-1)
        batch.out_cache_loc = slots.reshape(-1)
        batch.spec_info = NgramVerifyInput(
            custom_mask=custom_mask, positions=positions.reshape(-1), draft_token_num=t,
            new_seq_lens=batch.seq_lens)
        try:
            forward_batch = ForwardBatch.init_new(batch, self.model_runner,
                                                  return_hidden_states_before_norm=False)
        finally:
            batch.forward_mode = ForwardMode.DECODE
            batch.spec_info = state

        def run():  # the verify forward (its logits: computed when asked, StepLogits)
            return self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True)

        if self._torch_native:
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            layout = MaskedLayout(
                query_rows=[torch.arange(b * t, (b + 1) * t, device=self.device)
                            for b in range(bs)],
                prefix_slots=[req_to_token[r, :c].to(torch.int64) for r, c in
                              zip(batch.req_pool_indices.tolist(), committed.tolist())],
                masks=[torch.cat([torch.ones(t, c, dtype=torch.bool, device=self.device),
                                  new_mask], dim=1) for c in committed.tolist()])
            attention = MaskedAttention(self.model_runner.attn_backend, layout)
            with forward_context(ForwardContext(attn_backend=attention)):
                return step_logits(self.model_runner.model, run, bs, t)
        return step_logits(self.model_runner.model, run, bs, t)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        """The LM head on final hidden states (the model's logits processor computes the
        prompt's last row only; the branch rows come from the captured hidden states)."""
        weight = self.model_runner.model.lm_head.weight  # [padded vocab, hidden]
        logits = torch.matmul(hidden.to(weight.dtype), weight.t())  # [..., padded vocab]
        return logits[..., : self._vocab].float()
