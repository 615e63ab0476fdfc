"""ReFusion in SGLang's dLLM mode: ``--dllm-algorithm ReFusion`` (a ``DllmAlgorithm``).

Design notes: docs/design/sglang.md (section ``diffspec/spec_workers/sglang/refusion.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from diffspec.core.refusion import LogitsForwards, SlotRule, SlotRun, refusion_decode, slot_output
from diffspec.core.slots import longest_layout
from diffspec.spec_workers.sglang.fast_dllm import batch_requests, request_stop_ids
from diffspec.spec_workers.sglang.requests import refusion_request_error

__all__ = ["ReFusion"]


@dataclass
class _Rows:
    """One request's share of an engine forward: row r runs ``input_ids[r]`` at
    ``positions[r]`` as a causal extend of ``req_to_token`` row ``pools[r]`` after its first
    ``prefix`` KV entries."""

    pools: list[int]
    prefix: int
    input_ids: torch.Tensor  # [rows, n]
    positions: torch.Tensor  # [rows, n]


# A request's decoder: yields the rows of its next forward (None: waiting for scratch rows
# of the request pool) and is sent their fp32 logits [rows, n, vocab] (None after a wait).
_Decoder = Generator["_Rows | None", "torch.Tensor | None", None]


@dataclass(kw_only=True)
class _Block(SlotRun):
    """One request's SGLang block (its ``prompt_len`` KV entries are the prompt, causally
    encoded): committed slots are in the KV slots ``locs[:committed]``."""

    req: Any  # the scheduler's Req
    pool: int  # the request's req_to_token row
    locs: torch.Tensor  # [block_size] the block's KV slots (req_to_token[pool, prompt_len:])
    stops: tuple[int, ...]

    def rows(self, pools: list[int], start: int, input_ids: torch.Tensor,
             positions: torch.Tensor) -> _Rows:
        """Rows over the committed KV plus ``start`` entries of each row's own slot."""
        return _Rows(pools, self.kv_len + start, input_ids, positions)


class ReFusion(DllmAlgorithm):
    """ReFusion plan-and-infill; settings from ``algorithm_config`` (resolved and validated
    by :func:`diffspec.plugin.sglang.refusion.refusion_dllm_config`)."""

    requires_separate_context_encoding = True
    supported_architectures = ("Qwen3ForCausalLM",)

    def __init__(self, config: DllmConfig) -> None:
        super().__init__(config)
        cfg = config.algorithm_config
        self.rule = SlotRule.of(cfg, self.mask_id)
        self.slot_size = self.rule.slot_size
        self.vocab_size = int(cfg["vocab_size"])
        self._last_output = None  # the logits output of the latest forward (to the scheduler)

    @classmethod
    def validate_request(cls, req) -> str | None:
        cfg = req.dllm_config
        slot = int(cfg.algorithm_config["slot_size"])
        blocks = int(cfg.algorithm_config["num_blocks"])
        if req.sampling_params.max_new_tokens is None:
            # no max_tokens (an OpenAI chat call's default): SGLang would give the request what
            # is left of the context, which no block holds; it gets the block, as vLLM's canvas
            req.sampling_params.max_new_tokens = longest_layout(cfg.block_size, slot, blocks)
        return refusion_request_error(req, cfg.block_size, slot, blocks)

    def run(self, model_runner, forward_batch: ForwardBatch, algo_states=None):
        if not forward_batch.forward_mode.is_dllm_extend():  # the prompt's causal prefill
            out = model_runner.forward(forward_batch)
            return out.logits_output, [], None, None, out.can_run_graph
        # the stock Qwen3 returns the last logit; ReFusion reads every position's
        model_runner.model.logits_processor.return_full_logits = True
        req_to_token = model_runner.req_to_token_pool.req_to_token
        blocks = []
        for row, req in enumerate(batch_requests(forward_batch)):
            pool = int(forward_batch.req_pool_indices[row])
            prompt_len = int(forward_batch.extend_prefix_lens_cpu[row])
            first = int(forward_batch.positions[row * self.block_size])
            assert first == prompt_len, "ReFusion's block starts right after the prompt KV"
            locs = req_to_token[pool, prompt_len : prompt_len + self.block_size].clone()
            blocks.append(_Block(req=req, pool=pool, locs=locs, prompt_len=prompt_len,
                                 device=locs.device, stops=tuple(sorted(request_stop_ids(req)))))
        decoders = [refusion_decode(b, self.rule, _Forwards(self, model_runner, b),
                                    b.req.sampling_params.max_new_tokens, b.stops)
                    for b in blocks]
        try:
            self._drive(model_runner, forward_batch, decoders)
        finally:  # a decoder stopped mid-completion gives its scratch rows back
            for decoder in decoders:
                decoder.close()
        outputs = [torch.tensor(slot_output(b, b.stops, b.req.sampling_params.max_new_tokens),
                                dtype=torch.long) for b in blocks]
        return self._last_output, outputs, None, None, False

    def _drive(self, runner, template: ForwardBatch, decoders: list[_Decoder]) -> None:
        """Step every request's decoder until all are done: one engine forward per step
        over the rows of each request that has a forward to run."""
        # each request's next forward; None: not started yet, or waiting for free pool rows
        wants: dict[int, _Rows | None] = dict.fromkeys(range(len(decoders)))

        def advance(i: int, value: torch.Tensor | None) -> None:
            try:
                wants[i] = decoders[i].send(value)
            except StopIteration:
                del wants[i]

        while wants:
            for i in [i for i, w in wants.items() if w is None]:
                advance(i, None)
            ready = [i for i, w in wants.items() if w is not None]
            if wants and not ready:
                raise RuntimeError(
                    "raise --max-running-requests: ReFusion's parallel completion found too "
                    f"few free rows of SGLang's request pool "
                    f"({runner.req_to_token_pool.available_size()} free) for any request")
            if ready:
                logits = self._forward(runner, template, [wants[i] for i in ready])
                for i, out in zip(ready, logits):
                    advance(i, out)

    # ------------------------------------------------------------------ engine plumbing

    def _row_pools(self, runner, b: _Block, rows: int) -> list[int] | None:
        """``req_to_token`` rows for the completion: the request's own, then scratch rows
        holding its prefix entries and slot ``r``'s KV slots behind the committed ones;
        ``None`` while the pool has too few free rows."""
        S, table = self.slot_size, runner.req_to_token_pool.req_to_token
        scratch = runner.req_to_token_pool.alloc_rows(rows - 1)
        if scratch is None:
            return None
        prefix = b.prompt_len + b.committed
        for r, pool in enumerate(scratch, start=1):
            at = b.committed + r * S  # slot r's KV slots in the block
            table[pool, :prefix] = table[b.pool, :prefix]
            table[pool, prefix : prefix + S] = b.locs[at : at + S]
        return [b.pool, *scratch]

    def _forward(self, runner, template: ForwardBatch, parts: list[_Rows]
                 ) -> list[torch.Tensor]:
        """One causal ``DLLM_EXTEND`` forward over the rows of every part, ragged (the
        rows' tokens concatenated, each row with its own prefix and query length). Returns
        each part's fp32 logits [rows, n, vocab]."""
        table = runner.req_to_token_pool.req_to_token
        device = template.seq_lens.device
        pools = [pool for p in parts for pool in p.pools]
        prefix_cpu = [p.prefix for p in parts for _ in p.pools]
        ext_cpu = [p.input_ids.shape[1] for p in parts for _ in p.pools]
        pool_ids = torch.tensor(pools, dtype=template.req_pool_indices.dtype,
                                device=template.req_pool_indices.device)
        ext = torch.tensor(ext_cpu, dtype=template.extend_seq_lens.dtype, device=device)
        prefix = torch.tensor(prefix_cpu, dtype=template.extend_seq_lens.dtype, device=device)
        seq_lens = (prefix + ext).to(template.seq_lens.dtype)
        out_cache_loc = [table[p.pools, p.prefix : p.prefix + p.input_ids.shape[1]].reshape(-1)
                         for p in parts]
        fb = copy.copy(template)
        fb.forward_mode = ForwardMode.DLLM_EXTEND
        fb.batch_size = len(pools)
        fb.input_ids = torch.cat([p.input_ids.reshape(-1) for p in parts]).to(
            template.input_ids.dtype)
        fb.positions = torch.cat([p.positions.reshape(-1) for p in parts]).to(
            template.positions.dtype)
        fb.req_pool_indices = pool_ids
        fb.req_pool_indices_cpu = pool_ids.cpu()
        fb.out_cache_loc = torch.cat(out_cache_loc).to(template.out_cache_loc.dtype)
        fb.seq_lens, fb.orig_seq_lens = seq_lens, seq_lens
        fb.seq_lens_cpu = seq_lens.cpu()
        fb.seq_lens_sum = sum(prefix_cpu) + sum(ext_cpu)
        fb.extend_num_tokens = sum(ext_cpu)
        fb.extend_seq_lens = ext
        fb.extend_prefix_lens = prefix
        fb.extend_start_loc = torch.cumsum(ext, 0) - ext
        fb.extend_seq_lens_cpu = ext_cpu
        fb.extend_prefix_lens_cpu = prefix_cpu
        fb.extend_logprob_start_lens_cpu = list(ext_cpu)
        fb.dllm_prompt_mask = None
        fb.rids = None
        fb.return_logprob = False
        out = runner.forward(fb)
        self._last_output = out.logits_output
        logits = out.logits_output.full_logits[:, : self.vocab_size].float()
        sizes = [p.input_ids.numel() for p in parts]
        return [part.view(*p.input_ids.shape, -1)
                for p, part in zip(parts, logits.split(sizes))]


class _Forwards(LogitsForwards):
    """One request's forwards as rows of :meth:`ReFusion._drive`'s engine forwards: each
    yields its :class:`_Rows` (None: waiting for scratch rows of the request pool) and is
    sent their fp32 logits. Every forward writes its K/V behind the committed entries;
    the completion's rows hold their own slots' entries there, in commit order."""

    def __init__(self, algo: ReFusion, runner, block: _Block) -> None:
        self.algo, self.runner, self.b = algo, runner, block
        self.pools = [block.pool]  # the req_to_token row of each row (scratch ones: completion)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, start: int) -> _Decoder:
        return (yield self.b.rows(self.pools[: len(input_ids)], start, input_ids, positions))

    def open_rows(self, rows: int) -> _Decoder:
        while (pools := self.algo._row_pools(self.runner, self.b, rows)) is None:
            yield None  # other requests' completions hold the free pool rows
        self.pools = pools

    def close_rows(self) -> None:
        self.runner.req_to_token_pool.free_rows(self.pools[1:])
        self.pools = self.pools[:1]


Algorithm = ReFusion
