"""vLLM drafter for the two-pass self-speculative step (Orthrus, NLD linear): one
diffusion-view forward per step, on the target model's own layers and paged KV cache;
requests whose context holds an n-gram match take its continuation instead (prompt
lookup, no forward), and a step whose drafts all come from lookup runs no draft forward.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/two_pass.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from diffspec.core.carry import CarriedDrafts
from diffspec.core.lookup import LookupStats, ngram_lookup
from diffspec.profiling import DraftTimings
from diffspec.spec_workers.vllm.proposer import (
    adaptive_policy,
    draft_argmax,
    logger,
    measure_profile,
    non_causal_blocks,
    on_device,
    prompt_lookup,
    seeded_requests,
)

__all__ = ["DraftBlock", "TwoPassProposer", "chunks", "plan_blocks", "plan_v2_blocks"]


@dataclass(frozen=True)
class DraftBlock:
    """One request's draft block ``[anchor, <mask> x num_drafts]`` at positions
    ``start .. start + num_drafts``."""

    row: int  # the request's row in the runner's input batch (and block table)
    anchor: int  # last committed token id
    start: int  # the anchor's position = committed tokens - 1
    num_drafts: int


def plan_blocks(
    sampled_token_ids: list[list[int]],  # [num_reqs][tokens emitted this step]
    num_committed: list[int],  # [num_reqs] tokens committed so far (prompt + output)
    num_left: list[int | None],  # [num_reqs] max_tokens - output tokens (None: no limit)
    num_slots: list[int],  # [num_reqs] KV slots allocated to the request
    num_speculative_tokens: int,
    max_model_len: int,
) -> list[DraftBlock]:
    """The blocks to draft this step: one per request that emitted a token and may still
    take at least two more (an anchor's successor plus one draft)."""
    blocks = []
    for row, emitted in enumerate(sampled_token_ids):
        if not emitted:
            continue  # partial prefill or discarded request: nothing to draft from
        committed = num_committed[row]
        n = min(num_speculative_tokens, max_model_len - committed, num_slots[row] - committed)
        if num_left[row] is not None:
            n = min(n, num_left[row] - 1)
        if n > 0:
            blocks.append(DraftBlock(row, emitted[-1], committed - 1, n))
    return blocks


def plan_v2_blocks(
    num_sampled: list[int],  # [num_reqs] tokens the step emitted (0: a prefill chunk)
    anchor_positions: list[int],  # [num_reqs] the new anchor's position (committed - 1)
    num_slots: list[int],  # [num_reqs] KV slots the request holds (blocks x block size)
    num_drafts: int,  # drafts per request this step (the V2 runner's count)
    max_model_len: int,
) -> list[DraftBlock]:
    """The blocks the V2 runner's speculator drafts this step
    (:mod:`~diffspec.spec_workers.vllm.two_pass_v2`): one per request that emitted a token,
    cut to the model's length and the slots the request holds (``anchor`` -1: the anchors
    stay on the device). No ``max_tokens`` cut: the V2 runner verifies ``num_drafts`` per
    request whatever the block holds, and vLLM's scheduler drops tokens past ``max_tokens``."""
    blocks = []
    for row, (emitted, p) in enumerate(zip(num_sampled, anchor_positions)):
        n = min(num_drafts, max_model_len - 1 - p, num_slots[row] - 1 - p)
        if emitted > 0 and n > 0:
            blocks.append(DraftBlock(row, -1, p, n))
    return blocks


class TwoPassProposer:
    """The drafter vLLM's ``custom_class`` hook instantiates (``Proposer(vllm_config)``) for
    every diffspec self-speculative method (Orthrus, NLD linear self-speculation): the served
    model's class supplies the diffusion view, so the step is the same for both."""

    def __init__(self, vllm_config) -> None:
        from diffspec.methods import methods_for_engine

        spec = vllm_config.speculative_config
        arch = (getattr(vllm_config.model_config.hf_config, "architectures", None) or [""])[0]
        self.method = next((m.name for m in methods_for_engine(
                                "vllm", flag="--speculative-config").values()
                            if arch in m.architectures), "self-speculative")
        self.vllm_config = vllm_config
        self.num_speculative_tokens: int = spec.num_speculative_tokens
        self.mask_token_id = int(vllm_config.model_config.hf_config.mask_token_id)
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.max_forward_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens,
                                      self.num_speculative_tokens + 1)
        self.adaptive = adaptive_policy(vllm_config, self.num_speculative_tokens, "two_pass")
        self.prompt_lookup = prompt_lookup(vllm_config, self.method)
        self.lookup_stats = LookupStats()
        # the rest of over-drafted blocks (adaptive drafts only: a fixed count verifies
        # every draft it drafts)
        self.carried = (CarriedDrafts() if self.adaptive is not None
                        and self.adaptive.carry != "off" else None)
        self.timings = DraftTimings(vllm_config.device_config.device)

    def load_model(self, model) -> None:
        """Called by the runner with the target model: the drafter runs its diffusion view."""
        if not hasattr(model, "diffusion_hidden_states"):
            raise TypeError(f"method {self.method!r} needs a model with a diffusion view; "
                            f"{type(model).__name__} has none (check config.json architectures)")

    def measure_latency_profile(self, runner) -> None:
        """Called once after the worker's warm-up (patch ``warm_up_profile``): the adaptive
        policy's latency profile, from the cache or timed on the runner's own forwards up
        to the widest verify it can choose (every request drafting the full block)."""
        max_reqs = self.vllm_config.scheduler_config.max_num_seqs
        measure_profile(runner, self.adaptive, self.method,
                        max_reqs * (self.num_speculative_tokens + 1))

    def propose(self, *args, **kwargs):
        raise RuntimeError(f"method {self.method!r} drafts through diffspec's runner patch, "
                           f"which is not applied: is the diffspec vLLM plugin loaded "
                           f"(VLLM_PLUGINS)?")

    @torch.inference_mode()
    def propose_with_runner(self, runner, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        """Draft token ids ``[num_reqs][n_i]`` for the runner's current batch."""
        batch = runner.input_batch
        if self.adaptive is not None:  # a step boundary: the step since the last one ended;
            # one with a prefill chunk in it (a request that sampled nothing) is not learned
            self.adaptive.step_started(batch.req_ids if all(sampled_token_ids) else (),
                                       sum(len(t) for t in sampled_token_ids))
        num_left = []
        for req_id in batch.req_ids:
            state = runner.requests[req_id]
            params = state.sampling_params
            max_tokens = getattr(params, "max_tokens", None)
            num_left.append(None if max_tokens is None
                            else max_tokens - len(state.output_token_ids))
        table = batch.block_table[0]
        num_slots = (table.num_blocks_per_row[:len(num_left)] * table.block_size).tolist()
        blocks = plan_blocks(sampled_token_ids, batch.num_tokens_no_spec.tolist(), num_left,
                             num_slots, self.num_speculative_tokens, self.max_model_len)
        found, ngram = self._lookup(batch, blocks)  # [len(blocks)] lookup drafts, matched n
        sources = ["lookup"] * len(blocks)  # where each block's free drafts come from
        if self.adaptive is not None:
            req_ids = [batch.req_ids[b.row] for b in blocks]
            seeded = seeded_requests(runner, req_ids)
            carried = self._take_carried(batch.req_ids, sampled_token_ids, blocks, seeded)
            found, ngram, sources = self.adaptive.free_drafts(found, ngram, carried)
            blocks, found, verified, sources = _adapt(
                self.adaptive, batch.req_ids, sampled_token_ids, blocks, found, ngram, seeded,
                sources)
        else:  # a fixed count: a match's continuation wherever there is one
            blocks = [replace(b, num_drafts=len(f)) if f else b for b, f in zip(blocks, found)]
            verified = [b.num_drafts for b in blocks]  # drafts each block's step verifies
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for block, tokens, k, source in zip(blocks, found, verified, sources):
            drafts[block.row] = tokens[:k]
            if self.carried is not None and source == "carry":
                self.carried.keep(batch.req_ids[block.row], block.start, k, tokens)
        if self.prompt_lookup is not None or self.adaptive is not None:
            self._record([k for f, k, s in zip(found, verified, sources) if f and s == "lookup"],
                         sum(1 for f in found if not f),
                         [k for f, k, s in zip(found, verified, sources) if f and s == "carry"])
        # the diffusion view's blocks, drafting num_drafts (>= the k verified: the rest is
        # carried to the next step if all k pass)
        diffusion = [b for b, f in zip(blocks, found) if not f]
        verify = {b.row: k for b, k in zip(blocks, verified)}
        for chunk in chunks(diffusion, self.max_forward_tokens):
            chunk_drafts = self.timings.time(sum(b.num_drafts + 1 for b in chunk),
                                             lambda: self._draft(runner, chunk))  # noqa: B023
            for block, tokens in zip(chunk, chunk_drafts):
                k = verify[block.row]
                drafts[block.row] = tokens[:k]
                if self.carried is not None:
                    self.carried.keep(batch.req_ids[block.row], block.start, k, tokens)
        return drafts

    def _take_carried(self, req_ids: list[str], sampled_token_ids: list[list[int]],
                      blocks: list[DraftBlock], seeded: list[bool]) -> list[list[int]]:
        """Each block's carried drafts (:class:`~diffspec.core.carry.CarriedDrafts`; ``[]``:
        none, carrying off, or a seeded request: its drafts follow its own history)."""
        if self.carried is None:
            return [[] for _ in blocks]
        self.carried.forget(req_ids)
        return [[] if s else self.carried.take(req_ids[b.row], b.start, b.num_drafts,
                                               emitted=sampled_token_ids[b.row])
                for b, s in zip(blocks, seeded)]

    def _lookup(self, batch, blocks: list[DraftBlock]) -> tuple[list[list[int]], list[int]]:
        """Each block's prompt-lookup drafts (at most its ``num_drafts``; ``[]``: no match
        or lookup off), from the runner's committed tokens of its request (prompt +
        output, the anchor last: vLLM writes the sampled tokens there before drafting),
        and the length of the n-gram each matched (0: none)."""
        if self.prompt_lookup is None or not blocks:
            return [[] for _ in blocks], [0] * len(blocks)
        rows = np.array([b.row for b in blocks])
        lengths = np.array([b.start + 1 for b in blocks])  # [B] committed tokens
        tokens = torch.from_numpy(batch.token_ids_cpu[rows, :int(lengths.max())])  # [B, T]
        drafts, counts, ngram = ngram_lookup(tokens, torch.from_numpy(lengths),
                                             torch.tensor([b.num_drafts for b in blocks]),
                                             self.prompt_lookup, with_ngram=True)
        return ([row[:n].tolist() for row, n in zip(drafts, counts.tolist())],
                ngram.tolist())

    def _record(self, lookup: list[int], diffusion: int, carried: list[int]) -> None:
        """Count this step's draft sources (``lookup_stats``), with a log line now and
        then (:meth:`~diffspec.core.lookup.LookupStats.record`)."""
        if self.lookup_stats.record(lookup, diffusion, carried):
            logger.info("diffspec: %s", self.lookup_stats.summary())

    def _draft(self, runner, blocks: list[DraftBlock]) -> list[list[int]]:
        """One diffusion-view forward over ``blocks``; their draft token ids."""
        from vllm.forward_context import set_forward_context

        model = runner.get_model()
        lengths = np.array([b.num_drafts + 1 for b in blocks], dtype=np.int32)  # [B]
        batch = non_causal_blocks(runner, [b.row for b in blocks], [b.start for b in blocks],
                                  lengths, self.method)
        input_ids = np.full(batch.num_tokens, self.mask_token_id, dtype=np.int64)  # [T]
        input_ids[batch.query_start[:-1]] = [b.anchor for b in blocks]
        shift = 0 if model.draft_logits_shift else 1  # row of the block predicting draft 1
        predict = np.concatenate([np.arange(b.num_drafts) + s + shift
                                  for b, s in zip(blocks, batch.query_start)])  # [sum n]
        layer_slots = dict.fromkeys(batch.attn_metadata, batch.slot_mapping)
        with set_forward_context(batch.attn_metadata, runner.vllm_config,
                                 num_tokens=batch.num_tokens, slot_mapping=layer_slots):
            hidden = model.diffusion_hidden_states(on_device(runner, input_ids), batch.positions)
        tokens = draft_argmax(model, hidden, on_device(runner, predict))  # [sum n]
        if tokens is None:  # a TP rank that does not hold the gathered logits
            return [[] for _ in blocks]
        ends = np.cumsum([b.num_drafts for b in blocks])
        return [tokens[end - b.num_drafts:end] for b, end in zip(blocks, ends)]


def _adapt(policy, req_ids: list[str], sampled_token_ids: list[list[int]],
           blocks: list[DraftBlock], found: list[list[int]], ngram: list[int] | None = None,
           seeded: list[bool] | None = None, free_source: list[str] | None = None,
           ) -> tuple[list[DraftBlock], list[list[int]], list[int], list[str]]:
    """Feed this step's outcomes to ``policy``, let it pick each block's source (its
    free drafts ``found``, where there are some: lookup drafts matched on ``ngram`` tokens
    or carried drafts, as ``free_source`` says; or the diffusion view) and count
    (``seeded`` blocks: from their own history), and the diffusion view's draft widths
    (:meth:`~diffspec.core.adaptive.AdaptiveDrafts.draft_widths`); blocks cut to 0 drafts
    are dropped (a plain AR step for that request). Returns the blocks (``num_drafts``:
    what the diffusion view drafts), their free drafts (``[]``: the diffusion view's),
    the drafts each step verifies and the free drafts' sources."""
    for row, emitted in enumerate(sampled_token_ids):
        policy.observe(req_ids[row], len(emitted))
    policy.forget(set(req_ids))
    block_ids = [req_ids[b.row] for b in blocks]
    limits = [b.num_drafts for b in blocks]
    free_source = free_source or ["lookup"] * len(blocks)
    counts, free = policy.choose_hybrid(block_ids, limits, [len(f) for f in found], ngram,
                                        seeded, free_source)
    widths = policy.draft_widths(block_ids, counts, free, limits, seeded)
    if policy.steps % policy.log_every == 1:
        logger.info("diffspec: %s", policy.summary())
    kept = [(replace(b, num_drafts=w), f if use else [], k, s)
            for b, k, w, f, use, s in zip(blocks, counts, widths, found, free, free_source)
            if k > 0]
    return ([b for b, *_ in kept], [f for _, f, *_ in kept], [k for *_, k, _ in kept],
            [s for *_, s in kept])


def chunks(blocks: list[DraftBlock], max_tokens: int) -> list[list[DraftBlock]]:
    """Split ``blocks`` into forwards of at most ``max_tokens`` tokens each."""
    chunks: list[list[DraftBlock]] = []
    size = max_tokens
    for block in blocks:
        if size + block.num_drafts + 1 > max_tokens:
            chunks.append([])
            size = 0
        chunks[-1].append(block)
        size += block.num_drafts + 1
    return chunks
