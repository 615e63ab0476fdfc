"""SGLang worker for the two-pass self-speculative step (Orthrus, NLD linear): the
served model drafts with its own diffusion view and verifies with its AR view, on SGLang's
scheduler and KV pool; requests whose context holds an n-gram match take its continuation
instead (prompt lookup), and a step whose drafts all come from lookup runs no draft
forward.

Design notes: docs/design/sglang.md (section ``diffspec/spec_workers/sglang/two_pass.py``).
"""

from __future__ import annotations

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from diffspec.core.carry import CarriedDrafts
from diffspec.core.lookup import LookupStats, lookup_drafts
from diffspec.model_executors.sglang.views import DraftBlocks
from diffspec.profiling import DraftTimings
from diffspec.spec_workers.sglang.target_worker import (
    SpecDraftInput,
    StepLogits,
    TargetModelSpecWorker,
    accept,
    choice_metrics,
    logger,
    prompt_lookup,
    remaining,
    step_logits,
)

__all__ = ["TwoPassWorker"]


class TwoPassWorker(TargetModelSpecWorker):
    """Draft with the served model's diffusion view, verify with its AR view."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        model = self.model_runner.model
        if not hasattr(model, "diffusion_draft_tokens"):
            raise TypeError(
                f"--speculative-algorithm {self.method.upper()} needs a model with a diffusion "
                f"view; {type(model).__name__} has none (check config.json architectures)")
        self.mask_token_id = int(model.config.mask_token_id)
        max_len = getattr(model.config, "max_position_embeddings", None)
        self._max_position = int(max_len or self.model_runner.model_config.context_len) - 1
        self._offsets = torch.arange(self.width, device=self.device)  # [W]
        self.adaptive = self._adaptive_policy(self.width - 1, "two_pass")
        self.prompt_lookup = prompt_lookup(self.model_runner.model_config.hf_config,
                                           self.method)
        self.lookup_stats = LookupStats()
        # the rest of over-drafted blocks (adaptive drafts only; off with tensor
        # parallelism: the drafts' argmax is on the first rank alone)
        self.carried = (CarriedDrafts() if self.adaptive is not None
                        and self.adaptive.carry != "off" and self.server_args.tp_size == 1
                        else None)
        self.timings = DraftTimings(self.device)

    def _prefill(self, batch, on_publish) -> GenerationBatchResult:
        result = self._target_worker.forward_batch_generation(batch)
        return self._prefilled(result, batch, SpecDraftInput(
            bonus_tokens=result.next_token_ids.reshape(-1).to(torch.int64),
            new_seq_lens=batch.seq_lens), on_publish)

    @torch.inference_mode()
    def _decode(self, batch, on_publish) -> GenerationBatchResult:
        state: SpecDraftInput = batch.spec_info
        bs = len(batch.reqs)
        rids = [req.rid for req in batch.reqs]
        committed = batch.seq_lens.to(torch.int64)  # [bs] C
        lengths = batch.seq_lens_cpu.tolist()  # [bs] C, on the host
        # drafts per request, as the reference decoder: never past the request's budget
        # (accepted + 1 <= remaining; SGLang caps max_new_tokens at the context end) or
        # the model's positions (the anchor is at C)
        caps = [max(0, min(self.width - 1, remaining(req) - 1, self._max_position - c))
                for req, c in zip(batch.reqs, lengths, strict=True)]
        found, ngram = self._lookup(batch, caps)  # [bs] lookup drafts ([]: no match), n
        widths = caps  # drafts of each request's draft block (>= its count: carried)
        sources = ["lookup"] * bs
        if self.adaptive is not None:  # one width per step: W = the policy's k + 1
            self.measure_latency_profile()  # done at start-up, unless SGLang skipped the hook
            self.adaptive.forget(set(rids))
            limits = caps
            if self.carried is not None:
                self.carried.forget(rids)
                carried = [self.carried.take(rid, c, cap) for rid, c, cap in zip(
                    rids, lengths, caps, strict=True)]
                found, ngram, sources = self.adaptive.free_drafts(found, ngram, carried)
            k, lookup, caps = self.adaptive.choose_shared_hybrid(
                rids, caps, [len(f) for f in found], ngram, free_source=sources)
            widths = self.adaptive.draft_widths(rids, caps, lookup, limits)
            choice_metrics().record(k, bs)
            if self.adaptive.steps % self.adaptive.log_every == 1:
                logger.info("diffspec: %s", self.adaptive.summary())
            # a lookup row takes its first count drafts; a drafter row drafts count (0: a
            # step of the lookup drafts alone, no draft pass)
            kept = [f if use else [] for f, use in zip(found, lookup, strict=True)]
            found = [f[:c] for f, c in zip(kept, caps, strict=True)]
        else:  # a fixed count: a match's continuation wherever there is one
            caps = widths = [len(f) if f else cap for f, cap in zip(found, caps, strict=True)]
            kept = found
        w = 1 + max(caps)  # one width per step (SGLang's verify); narrower blocks padded
        wd = 1 + max(widths)  # the draft pass's (wider where blocks are over-drafted)
        num_drafts = torch.tensor(caps, dtype=torch.int64, device=self.device)  # [bs]
        anchors = state.bonus_tokens.reshape(-1).to(torch.int64)  # [bs]
        diffusion = sum(1 for f, n in zip(found, caps) if n > 0 and not f)  # rows it drafts
        if self.prompt_lookup is not None or self.adaptive is not None:
            self._record([len(f) for f, s in zip(found, sources) if f and s == "lookup"],
                         diffusion, [len(f) for f, s in zip(found, sources) if f and s == "carry"])
        columns = committed[:, None] + self._offsets[None, :wd]  # [bs, W_d]
        rows = batch.req_pool_indices.to(torch.int64)  # [bs]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token  # [reqs, ctx]
        slots = req_to_token[rows[:, None], columns].to(torch.int64)  # [bs, W]
        # a padded row may sit past the model's last position (never committed); RoPE
        # needs positions it has
        positions = columns.clamp(max=self._max_position)  # [bs, W_d]

        # draft: the diffusion view over each request's [anchor, <mask> x n] (n = its
        # block's width: its draft count, or more where over-drafted; the block's padding
        # rows are invisible to it), unless every drafting request has free drafts (W = 1:
        # nothing is drafted this step, a plain AR step); lookup and carry rows take those
        block = None
        if diffusion:
            block = self.timings.time(bs * wd, lambda: self._draft(
                batch, anchors, positions, slots, torch.tensor(
                    widths, dtype=torch.int64, device=self.device)))  # [bs, W_d - 1]
            # the verify's drafts (lookup rows are written in): the block itself unless
            # over-drafted, then a copy, the block's rest kept for _carry
            drafts = block if wd == w else block[:, :w - 1].clone()
        else:
            drafts = anchors.new_zeros((bs, w - 1))
        positions, slots = positions[:, :w], slots[:, :w]  # [bs, W]: the verify's
        for b, tokens in enumerate(found):
            if tokens:
                drafts[b, :len(tokens)] = torch.tensor(tokens, dtype=drafts.dtype)
        padding = self._offsets[None, : w - 1] >= num_drafts[:, None]  # [bs, W - 1]

        # verify: SGLang's causal forward of [anchor, drafts] into the reserved slots
        verify_ids = torch.cat([anchors[:, None], drafts], dim=1)  # [bs, W]
        logits = (self._verify(batch, verify_ids, positions, slots) if w == 1  # [bs, W, vocab]
                  else self.timings.time(bs * w, lambda: self._verify(
                      batch, verify_ids, positions, slots), kind="verify"))

        # accept: greedy rows take the longest prefix equal to the AR argmax, then the AR
        # token after it; sampled rows rejection-sample the point-mass drafts
        accepted = accept(drafts, logits, batch, committed, padding)
        accept_lens = accepted.num_emitted.to(torch.int32)  # [bs] accepted + 1
        out = accepted.output_token_ids  # [bs, W]: emitted tokens, then -1
        new_seq_lens = batch.seq_lens + accept_lens.to(batch.seq_lens.dtype)
        bonus = out.gather(1, accepted.num_accepted[:, None]).reshape(-1)  # [bs] next anchor
        if self.adaptive is not None:
            for rid, emitted in zip(rids, accept_lens.tolist(), strict=True):
                self.adaptive.observe(rid, emitted)
        if self.carried is not None:
            self._carry(rids, lengths, caps, widths,
                        [f if src == "carry" else [] for f, src in zip(kept, sources)], block,
                        out, accept_lens.tolist())
        return self._decoded(out, accept_lens, new_seq_lens, SpecDraftInput(
            bonus_tokens=bonus, new_seq_lens=new_seq_lens), w, on_publish)

    def _carry(self, rids: list[str], committed: list[int], counts: list[int],
               widths: list[int], free: list[list[int]], block: torch.Tensor | None,
               out: torch.Tensor, emitted: list[int]) -> None:
        """Keep each request's carried drafts for its next step
        (:class:`~diffspec.core.carry.CarriedDrafts`): the rest of its over-drafted block
        (``block[b, :widths[b]]``) or of its carried drafts (``free[b]``, untrimmed), when
        the step verified ``counts[b]`` of them, all passed and the verify's token matched
        (lookup rows: ``free[b]`` empty and not drafted, nothing kept)."""
        wide = block is not None and any(w > k for w, k in zip(widths, counts))
        if not wide and not any(free):
            return  # nothing to keep (take() consumed what was kept for these requests)
        rows = out.tolist()  # [bs][W]: emitted tokens, then -1 (one copy to the host)
        blocks = block.tolist() if wide else None  # [bs][W_d - 1]
        for b, rid in enumerate(rids):
            tokens = (free[b] if free[b] else [] if blocks is None or widths[b] <= counts[b]
                      else blocks[b][:widths[b]])
            self.carried.keep(rid, committed[b], counts[b], tokens)
            self.carried.settle(rid, rows[b][:emitted[b]])

    def _lookup(self, batch, caps: list[int]) -> tuple[list[list[int]], list[int]]:
        """Each request's prompt-lookup drafts (at most its cap; ``[]``: no match or
        lookup off) from its committed tokens (prompt + output, the anchor last), and the
        length of the n-gram each matched (0: none)."""
        if self.prompt_lookup is None:
            return [[] for _ in caps], [0] * len(caps)
        contexts = [[*req.origin_input_ids, *req.output_ids] for req in batch.reqs]
        return lookup_drafts(contexts, caps, self.prompt_lookup, with_ngram=True)

    def _record(self, lookup: list[int], diffusion: int, carried: list[int]) -> None:
        """Count this step's draft sources (``lookup_stats``, and Prometheus counters), with
        a log line now and then (:meth:`~diffspec.core.lookup.LookupStats.record`)."""
        if lookup or diffusion or carried:
            choice_metrics().record_sources(lookup, diffusion, carried)
        if self.lookup_stats.record(lookup, diffusion, carried):
            logger.info("diffspec: %s", self.lookup_stats.summary())

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
        return self._run_model(forward_batch, lambda: (  # argmax a chunk of rows at a time
            self.model_runner.model.diffusion_draft_tokens(DraftBlocks(
                block.reshape(-1), positions.reshape(-1), w, forward_batch))))  # [bs, W - 1]

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

    def _verify(
        self,
        batch,
        verify_ids: torch.Tensor,  # [bs, W]
        positions: torch.Tensor,  # [bs, W]
        slots: torch.Tensor,  # [bs, W] KV-pool slots of positions C .. C + W - 1
    ) -> torch.Tensor | StepLogits:  # [bs, W, vocab] fp32 logits
        """The verify forward; its logits are computed by the accept rules, a chunk of
        requests at a time (:class:`StepLogits`)."""
        bs, w = verify_ids.shape
        if w == 1:  # nothing drafted this step (adaptive k = 0): a plain decode step
            return self._decode_forward(batch, verify_ids[:, 0], slots[:, 0])
        forward_batch = self._step_batch(batch, verify_ids, positions, slots)
        if self._torch_native:  # decode rows: more rows than the runner's decode buffers
            return step_logits(self.model_runner.model,
                               lambda: self._run_model(forward_batch), bs, w)
        return step_logits(self.model_runner.model, lambda: (
            self._target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True)), bs, w)
