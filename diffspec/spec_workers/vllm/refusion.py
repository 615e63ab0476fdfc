"""ReFusion on vLLM's diffusion path (the diffusion scheduler, the V2 model runner):
:class:`ReFusionModelState` and its :class:`ReFusionSampler`, which decodes every request
of a step with the reference's plan-and-infill rounds on vLLM's paged KV cache.

Design notes: docs/design/vllm.md (section ``diffspec/spec_workers/vllm/refusion.py``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from diffspec.core.refusion import SlotForwards, SlotRule, SlotRun, refusion_decode, slot_output
from diffspec.spec_workers.vllm.diffusion_state import (
    FINISHED_KEPT,
    CanvasSampler,
    DiffusionModelState,
    request_stops,
)
from diffspec.spec_workers.vllm.forward import decoder_forward
from diffspec.spec_workers.vllm.proposer import DRAFT_LOGITS_ROWS
from diffspec.spec_workers.vllm.split_attention import SplitAttention, swap_attention

__all__ = ["ReFusionModelState", "ReFusionSampler", "logit_rows"]

logger = logging.getLogger("vllm.diffspec")

PREFILL, DECODE, DONE = 0, 1, 2  # a request's phase


@dataclass
class _Seq:
    """One attention sequence of an engine forward: ``input_ids`` at ``positions``, whose
    K/V go to the request's cache entries ``kv_start ..`` and which attends causally to
    entries ``0 .. kv_start + n - 1``. Sequences of one request that share entries run in
    separate attention calls (``phase``); ``final``: the entry their K/V are also copied to.
    The decoder reads the logits of rows ``logits_from ..`` only (``n``: none)."""

    batch: int  # the request's row in this step's input batch (its block table row)
    input_ids: Tensor  # [n]
    positions: Tensor  # [n]
    kv_start: int
    phase: int = 0
    final: int | None = None
    logits_from: int = 0


@dataclass
class _RowStats:
    """What the decoder reads of a sequence's fp32 logits, rows ``logits_from ..`` of it
    (:func:`logit_rows`, on the host): each row's argmax, its largest softmax probability
    (the plan score of :func:`~diffspec.core.slots.score_slots`) and the softmax
    probability of the sequence's next input token (what the token-threshold acceptance
    reads; the last row's is of the sequence's first input, unused)."""

    argmax: Tensor  # [r] int64
    top_prob: Tensor  # [r] fp32
    next_prob: Tensor  # [r] fp32


# A request's decoder: yields the sequences of its next forward, is sent their row stats.
_Decoder = Generator[list[_Seq], list[_RowStats], None]


def logit_rows(logits_of: Callable[[Tensor], Tensor], source: Tensor, index: Tensor,
               targets: Tensor, rows: int = DRAFT_LOGITS_ROWS) -> tuple[Tensor, Tensor, Tensor]:
    """For each row ``r``, the logits ``logits_of(source[index[r]])`` (``[vocab]``, in fp32):
    their argmax, their largest softmax probability and the softmax probability of token
    ``targets[r]`` (three ``[R]`` tensors on ``source``'s device), computed ``rows`` rows
    at a time: at most ``rows x vocab`` logits (and as many probabilities) exist at once,
    whatever ``R`` (issue 29, row 8; vLLM's memory profile does not see them)."""
    argmax, top, target = [], [], []
    for start in range(0, index.numel(), rows):
        logits = logits_of(source[index[start:start + rows]]).float()  # [<= rows, vocab]
        probs = torch.softmax(logits, dim=-1)
        argmax.append(logits.argmax(dim=-1))
        top.append(probs.max(dim=-1).values)
        target.append(probs.gather(-1, targets[start:start + rows, None])[:, 0])
        del logits, probs  # freed before the next chunk's
    if not argmax:
        empty = torch.empty(0, device=source.device)
        return empty.long(), empty, empty
    return torch.cat(argmax), torch.cat(top), torch.cat(target)


def _row_stats(logits_of: Callable[[Tensor], Tensor], source: Tensor, index: Tensor,
               targets: Tensor, counts: list[int], rows: int) -> list[_RowStats]:
    """:func:`logit_rows` (``index`` and ``targets`` on the host), on the host and split
    into :class:`_RowStats` of ``counts`` rows each."""
    device = source.device
    stats = logit_rows(logits_of, source, index.to(device), targets.to(device), rows)
    return [_RowStats(*part) for part in zip(*(t.cpu().split(counts) for t in stats))]


@dataclass
class _Request(SlotRun):
    """One request in flight (host side), kept by its vLLM slot; its ``prompt_len`` and
    ``batch`` are set when its decoding step starts."""

    max_tokens: int
    stops: tuple[int, ...]
    phase: int = PREFILL
    batch: int = -1  # its row in the decoding step's input batch


class ReFusionModelState(DiffusionModelState):
    """vLLM model state of a ReFusion checkpoint: the prompt is vLLM's causal prefill; the
    canvas forward of the next step is the first plan, and the sampler runs the rest."""

    states: dict[int, _Request]

    def __init__(self, vllm_config: VllmConfig, model: nn.Module, encoder_cache: Any,
                 device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        extra = vllm_config.additional_config if isinstance(
            vllm_config.additional_config, dict) else {}
        settings = (extra.get("diffspec") or {}).get("refusion")
        if vllm_config.diffusion_config is None or not settings:
            raise ValueError(
                "load diffspec's vLLM plugin in every vLLM process (it is the "
                "vllm.general_plugins entry point 'diffspec'): ReFusion's settings were not "
                "resolved by its config hook (diffspec.plugin.vllm.refusion)")
        self.rule = SlotRule.of(settings, settings["mask_token_id"])
        self.slot_size, self.num_blocks = self.rule.slot_size, self.rule.num_blocks
        self.mask_token_id = self.rule.mask_token_id
        self.canvas = int(vllm_config.diffusion_config.canvas_length)
        # vLLM hashes a request's generated blocks into the prefix cache (0.33 whenever
        # drafts are scheduled, async scheduling always): their K/V must then be what a
        # causal prefill of that text writes, not ReFusion's commit-order K/V
        self.reencode = bool(vllm_config.cache_config.enable_prefix_caching)
        self.vllm_config = vllm_config
        self.logits_rows = DRAFT_LOGITS_ROWS  # rows of logits computed at once
        # the last canvas steps (bounded): (the request ids each decoded, the forwards they
        # shared after it)
        self.decode_steps: deque[tuple[list[str], int]] = deque(maxlen=FINISHED_KEPT)
        self._attn: tuple[Any, ...] | None = None  # this step's block table, groups, config

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
        return ReFusionSampler(sampler, self), None

    def prepare_attn(self, input_batch: Any, cudagraph_mode: CUDAGraphMode, block_tables: Any,
                     slot_mappings: torch.Tensor, attn_groups: Any, kv_cache_config: Any,
                     *args: Any, **kwargs: Any) -> dict[str, Any]:
        """vLLM's causal metadata; keeps the step's block table for the sampler's forwards."""
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("ReFusion on vLLM needs one KV cache group (a plain Qwen3)")
        self._attn = (block_tables[0][: input_batch.num_reqs].clone(), attn_groups,
                      kv_cache_config)
        return super().prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings,
                                    attn_groups, kv_cache_config, *args, **kwargs)

    # ------------------------------------------------------------------ engine forwards

    def forward(self, seqs: list[_Seq]) -> list[_RowStats]:
        """One eager forward of the model over ``seqs`` on the paged KV cache; returns each
        sequence's :class:`_RowStats`, computed from the forward's final hidden states
        ``logits_rows`` rows at a time, for the rows the decoder reads only: the logits
        of the whole forward never exist."""
        hidden = self._hidden(seqs)  # [T, hidden]
        sizes = [len(s.input_ids) for s in seqs]
        firsts = np.cumsum([0, *sizes[:-1]]).tolist()
        index = torch.cat([torch.arange(f + s.logits_from, f + n)
                           for f, n, s in zip(firsts, sizes, seqs)])
        targets = torch.cat([s.input_ids.roll(-1)[s.logits_from:] for s in seqs])
        return _row_stats(self.model.compute_logits, hidden, index, targets,
                          [n - s.logits_from for n, s in zip(sizes, seqs)], self.logits_rows)

    def _hidden(self, seqs: list[_Seq]) -> Tensor:  # [T, hidden]
        """The final hidden states of one eager forward over ``seqs``, in order."""
        from vllm.forward_context import set_forward_context

        block_table, groups, kv_config = self._attn
        block_size = kv_config.kv_cache_groups[0].kv_cache_spec.block_size
        device = self.device
        sizes = [len(s.input_ids) for s in seqs]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        input_ids = torch.cat([s.input_ids for s in seqs]).to(device)
        positions = torch.cat([s.positions for s in seqs]).to(device)

        def slots(s: _Seq, first: int) -> Tensor:  # [n] the cache slots of entries first ..
            entry = first + torch.arange(len(s.input_ids), device=device)
            return (block_table[s.batch, entry // block_size].long() * block_size
                    + entry % block_size)

        phases = []  # (token index, metadata, slot mapping by layer), last phase first
        for p in sorted({s.phase for s in seqs}, reverse=True):
            part = [i for i, s in enumerate(seqs) if s.phase == p]
            index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part]).to(device)
            query = torch.tensor([0, *np.cumsum([sizes[i] for i in part])], dtype=torch.int32)
            seq_lens = torch.tensor([seqs[i].kv_start + sizes[i] for i in part],
                                    dtype=torch.int32)
            mapping = torch.cat([slots(seqs[i], seqs[i].kv_start) for i in part])
            metadata = build_attn_metadata(
                attn_groups=groups, num_reqs=len(part), num_tokens=len(index),
                query_start_loc_gpu=query.to(device), query_start_loc_cpu=query,
                max_query_len=max(sizes[i] for i in part), seq_lens=seq_lens.to(device),
                max_seq_len=int(seq_lens.max()),
                block_tables=(block_table[[seqs[i].batch for i in part]],),
                slot_mappings=mapping[None], kv_cache_config=kv_config,
                seq_lens_cpu_upper_bound=seq_lens, positions=positions[index],
                is_prefilling=torch.ones(len(part), dtype=torch.bool))
            phases.append((index, metadata, build_slot_mappings_by_layer(mapping[None],
                                                                         kv_config)))
        copies = [i for i, s in enumerate(seqs) if s.final is not None]
        final = None
        if copies:
            index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in copies])
            final = (index.to(device), torch.cat([slots(seqs[i], seqs[i].final)
                                                  for i in copies]))
        model = self.model
        _, metadata, mapping = phases[0]
        with set_forward_context(metadata, self.vllm_config, num_tokens=len(input_ids),
                                 slot_mapping=mapping), \
                _phased_attention(model, phases if len(phases) > 1 or final else None, final):
            return decoder_forward(model.model, input_ids, positions)


def _phased_attention(model: nn.Module, phases: list | None, final: tuple | None):
    """Swap every layer's ``Attention`` for a :class:`_PhasedAttention` (``phases`` None:
    one attention call per layer, the forward context's)."""
    if phases is None:
        return nullcontext()
    return swap_attention(model, lambda attn: _PhasedAttention(attn, phases, final))


class _PhasedAttention(SplitAttention):
    """One layer's attention as one call per phase (the parallel-completion rows of a
    request share its cache entries after the committed ones: each row writes its K/V
    there and attends, row 0 last, so row 0's K/V stay in place), then the K/V of the other
    rows are written to their commit-order entries (``final``)."""

    def __init__(self, attn: nn.Module, phases: list, final: tuple | None) -> None:
        super().__init__(attn)
        self.phases = phases
        self.final = final

    def calls(self, slot_mapping: Tensor) -> tuple[list, tuple | None]:
        name = self.attn.layer_name
        return [(index, metadata[name], mapping[name])
                for index, metadata, mapping in self.phases], self.final


# ------------------------------------------------------------------------------ sampler


class ReFusionSampler(CanvasSampler):
    """Replaces vLLM's sampler for ReFusion: after a request's prefill its canvas (draft
    tokens) is all masks; on its canvas step the request's whole generation is decoded
    (with the other decoding requests of the step, several per forward) and emitted."""

    method, rules = "ReFusion", "slot"
    state: ReFusionModelState

    def __init__(self, sampler: Any, state: ReFusionModelState) -> None:
        super().__init__(sampler, state, state.canvas)

    def new_state(self, sampling_params: Any) -> _Request:
        return _Request(max_tokens=int(sampling_params.max_tokens),
                        stops=tuple(request_stops(sampling_params)))

    def __call__(self, logits: Tensor, input_batch: Any,
                 draft_logits: Tensor | None = None) -> SamplerOutput:
        # logits: [num_logits, vocab]; a canvas step has its scheduled rows, a prefill none
        state, S = self.state, self.state.slot_size
        num_reqs, slots, cu, _, query, emit, rejected, sampled = self._begin_step(input_batch)
        decoding: list[tuple[int, _Request]] = []
        for i, req, rows, prefilled in self._step_requests(input_batch, slots, cu):
            if req.phase == PREFILL:
                if prefilled:
                    req.phase = DECODE
                continue
            rejected[i] = int(query[i])  # unless it decodes below
            if req.phase == DONE:  # a step scheduled before the finish was seen
                continue
            gen_len = _gen_len(req.max_tokens, S)
            if rows < gen_len:
                computed = int(input_batch.num_computed_tokens_np[i])
                if computed + rows < state.max_model_len:
                    continue  # cut for the token budget: rescheduled whole
                raise RuntimeError(
                    f"ReFusion got {rows} canvas slots for a request that needs {gen_len} "
                    f"(max_model_len {state.max_model_len}): the request checks of "
                    f"diffspec.plugin.vllm.refusion should have refused it; is diffspec's "
                    f"vLLM plugin loaded in the front-end process?")
            req.batch, req.prompt_len = i, int(input_batch.num_computed_tokens_np[i])
            decoding.append((i, req))
        if decoding:
            self._decode([r for _, r in decoding], self._first_plans(logits, decoding, cu),
                         input_batch)
            outputs = [slot_output(req, req.stops, req.max_tokens) for _, req in decoding]
            if state.reencode:
                self._reencode([r for _, r in decoding], outputs, input_batch)
            for (i, req), tokens in zip(decoding, outputs):
                emit[i], rejected[i] = len(tokens), int(query[i]) - len(tokens)
                sampled[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                req.phase = DONE
        self._write_canvases(slots)
        return self._output(num_reqs, sampled, emit, rejected)

    def _first_plans(self, logits: Tensor, decoding: list[tuple[int, _Request]],
                     cu: np.ndarray) -> list[_RowStats]:
        """The first plan of each decoding request: the :class:`_RowStats` of its canvas
        forward's rows (vLLM's ``logits``) that plan its first serial block (inputs all
        masks), ``logits_rows`` rows at a time."""
        st = self.state
        counts = [_plan_rows(r.max_tokens, st.slot_size, st.num_blocks) for _, r in decoding]
        index = torch.cat([int(cu[i]) + torch.arange(n) for (i, _), n in zip(decoding, counts)])
        return _row_stats(lambda rows: rows, logits, index,
                          torch.full_like(index, st.mask_token_id), counts, st.logits_rows)

    def _decode(self, reqs: list[_Request], firsts: list[_RowStats], input_batch: Any) -> None:
        """Every request's rounds to the end; one engine forward per round holds the
        sequences of every request that has a forward to run."""
        decoders = [self._rounds(r, f) for r, f in zip(reqs, firsts)]
        wants: dict[int, list[_Seq]] = {}

        def advance(k: int, value: list[Tensor] | None) -> None:
            try:
                wants[k] = decoders[k].send(value) if value is not None else next(decoders[k])
            except StopIteration:
                wants.pop(k, None)

        for k in range(len(decoders)):
            advance(k, None)
        req_ids, forwards = input_batch.req_ids, 0
        while wants:
            forwards += 1
            ready = list(wants)
            seqs = [s for k in ready for s in wants[k]]
            outs = iter(self.state.forward(seqs))
            for k in ready:
                rid = req_ids[reqs[k].batch]
                self.state.forwards.count(rid)
                advance(k, [next(outs) for _ in wants[k]])
        self.state.decode_steps.append(([req_ids[r.batch] for r in reqs], forwards))

    def _rounds(self, req: _Request, first: _RowStats) -> _Decoder:
        """The request's serial blocks, round after round (the reference's rounds);
        ``first``: the canvas forward's, the first round's plan."""
        st = self.state
        return refusion_decode(req, st.rule, _Forwards(req, st.slot_size, first),
                               req.max_tokens, req.stops)

    def _reencode(self, reqs: list[_Request], outputs: list[list[int]],
                  input_batch: Any) -> None:
        """One causal forward over every request's output in position order after its
        prompt: the K/V a causal prefill of that text writes, which is what vLLM's prefix
        cache may hand a later prompt holding it (one forward more than the reference)."""
        seqs = [_Seq(r.batch, torch.tensor(out), r.prompt_len + torch.arange(len(out)),
                     r.prompt_len, logits_from=len(out)) for r, out in zip(reqs, outputs)]
        self.state.forward(seqs)
        for r in reqs:
            rid = input_batch.req_ids[r.batch]
            self.state.forwards.count(rid)

    # ------------------------------------------------------------------ engine plumbing

    def _write_canvases(self, slots: list[int]) -> None:
        """Every live request's canvas (its next draft tokens) is all masks."""
        live = [s for s in slots if s in self.state.states]
        if live:
            draft = self.req_states.draft_tokens
            index = torch.tensor(live, dtype=torch.long, device=draft.device)
            draft[index, : self.state.canvas] = self.state.mask_token_id


def _gen_len(max_tokens: int, slot_size: int) -> int:
    """``max_tokens`` rounded up to whole slots (the reference's ``layout``)."""
    return -(-max_tokens // slot_size) * slot_size


def _plan_rows(max_tokens: int, slot_size: int, num_blocks: int) -> int:
    """Positions of one serial block (whole slots): the rows of its first plan."""
    return _gen_len(max_tokens, slot_size) // slot_size // num_blocks * slot_size


class _Forwards(SlotForwards):
    """One request's forwards as sequences of :meth:`ReFusionSampler._decode`'s engine
    forwards: each yields its :class:`_Seq` list and is sent their :class:`_RowStats`.
    ``first``: the canvas forward's row stats, the first round's plan."""

    def __init__(self, req: _Request, slot_size: int, first: _RowStats) -> None:
        self.req, self.slot_size = req, slot_size
        self.first: _RowStats | None = first

    def plan(self, input_ids: Tensor, positions: Tensor) -> _Decoder:
        m, S = positions.shape
        plan, self.first = self.first, None
        if plan is None:  # (the first plan is the canvas forward: masks from the prompt on)
            [plan] = yield [_Seq(self.req.batch, input_ids.view(-1), positions.view(-1),
                                 self.req.kv_len)]
        n = m * S
        return plan.top_prob[:n].view(m, S)[:, 0], plan.argmax[:n].view(m, S)

    def verify(self, input_ids: Tensor, positions: Tensor) -> _Decoder:
        k, S = positions.shape
        [out] = yield [_Seq(self.req.batch, input_ids.view(-1), positions.view(-1),
                            self.req.kv_len)]
        return out.next_prob.view(k, S)[:, :-1]

    def draft(self, input_ids: Tensor, positions: Tensor, start: int) -> _Decoder:
        outs = yield self._rows(input_ids, positions, start)
        return torch.stack([o.argmax for o in outs])  # [rows, S - start]

    def check(self, input_ids: Tensor, positions: Tensor, start: int) -> _Decoder:
        outs = yield self._rows(input_ids, positions, start)
        return torch.stack([o.next_prob for o in outs])[:, :-1]

    def _rows(self, tokens: Tensor, positions: Tensor, start: int) -> list[_Seq]:
        """The completion forward's sequences. One row: its window ``[start:]`` over the
        committed KV and its own first ``start`` entries. Several rows: each row whole, in
        its own attention call over the committed KV (they share the entries after it),
        and rows ``r >= 1`` copied to their commit-order entries (row ``r`` after ``r``
        full slots: only the last row may be cut, by a stop). Either way the logits of
        the window ``[start:]`` are read."""
        b, L, S = self.req.batch, self.req.kv_len, self.slot_size
        if len(tokens) == 1:
            return [_Seq(b, tokens[0, start:], positions[0, start:], L + start)]
        return [_Seq(b, tokens[r], positions[r], L, phase=r, final=L + r * S if r else None,
                     logits_from=start) for r in range(len(tokens))]
