"""The GPU check (issue 29, item 4): what diffspec's engine paths assume of a GPU, checked on
one, with the figures written to a JSON file the results page shows.

    python scripts/gpu_check.py --device cuda --out gpu-check.json   # on an H100 / H200
    python scripts/gpu_check.py --device cpu --quick --out x.json     # the CPU test of it

Needs PyTorch and transformers only (no vLLM, SGLang or network); ``scripts/gpu_check.sh``
runs it after the ``gpu`` test tier. Every check asserts what it checks; one that fails is
recorded with its error and the command exits 1. Checks:

* ``core_rules``: accept (greedy, coupled), confidence unmasking (ties, a confidence equal
  to the threshold), per-row penalties, the quadratic / block-causal masks and the slot
  rules on the device, in fp32 and bf16, against the same inputs on CPU: identical
  decisions.
* ``tidar_split_attention``: vLLM TiDAR's attention schedule as diffspec's code runs it
  (``tidar.build_branches`` and ``_QuadraticAttention.forward``: causal verify, then
  the branches from the last to the first, each non-causal over the request's paged cache
  with its K/V written over the slots of its own positions, then the verify K/V written
  back), the backend's metadata and kernel stood in by a paged SDPA, against one dense
  attention under the quadratic mask, on a random paged cache with several requests in one
  forward: same outputs, and the cache left exactly as a plain verify leaves it.
* ``decoders_bf16``: the five reference decoders (orthrus, linear_self_spec, tidar,
  fast_dllm, refusion) on their bundled models, on the device in fp32 (equal to CPU fp32)
  and bf16 (the share of tokens equal to fp32 before the first difference).
* ``draft_logits_memory``: the logits a draft pass materialises for ``rows`` rows at
  Qwen3-8B's vocabulary (151936), computed whole and in chunks of 1024 rows: peak memory of
  each (CUDA) and equal argmax drafts.
* ``masked_attention``: SGLang TIDAR's ``MaskedAttention`` at Qwen3-8B's heads, 1k-8k
  context: equal to dense fp32 attention under the same masks, time per call, peak memory
  under the per-request working-set bound (CUDA).
* ``draft_pass``: a 2-layer draft pass at Qwen3-8B's shape, eager vs CUDA graph (equal
  hidden states within bf16 tolerance, equal drafts; times), and its LM head's logits whole
  vs chunked (equal drafts; chunked peak under ``chunk x vocab``, below whole; CUDA). On CPU
  the graph is skipped with its reason.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- core rules


def check_core_rules(device: torch.device, quick: bool) -> dict:
    from diffspec.core.accept import coupled_accept, greedy_accept
    from diffspec.core.masks import block_causal_mask, quadratic_mask
    from diffspec.core.penalties import RequestPenalties, apply_penalties_per_row
    from diffspec.core.sampling import position_gumbel_noise, process_logits
    from diffspec.core.slots import score_slots, select_slots, verify_slot_drafts
    from diffspec.core.unmask import confidence_unmask

    figures: dict = {}
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        logits = torch.randn(4, 6, 64, generator=gen).to(dtype)  # [batch, n + 1, vocab]
        drafts = logits[:, :5].float().argmax(-1)  # [batch, n]
        drafts[1, 2] = (drafts[1, 2] + 1) % 64  # a rejection mid-block
        drafts[3, 0] = (drafts[3, 0] + 1) % 64  # a rejection at the first draft
        logits[2, 1, :] = 0.0  # an all-equal row: argmax ties go to the lowest index
        cpu = greedy_accept(drafts, logits)
        dev = greedy_accept(drafts.to(device), logits.to(device))
        assert torch.equal(cpu.output_token_ids, dev.output_token_ids.cpu()), f"greedy {name}"

        processed = process_logits(logits.float(), 0.8, 8, 0.9)
        noise = torch.stack([position_gumbel_noise(7, list(range(10, 16)), 64)] * 4)
        cpu = coupled_accept(drafts, processed, noise)
        dev = coupled_accept(drafts.to(device), processed.to(device), noise.to(device))
        assert torch.equal(cpu.output_token_ids, dev.output_token_ids.cpu()), f"coupled {name}"

        # unmasking: an exact tie between two positions and one confidence equal to the
        # threshold (strictly greater passes: it must not be committed by the threshold)
        block = torch.full((2, 8, 16), -30.0)
        block[0, 2, 5] = block[0, 5, 5] = 5.0  # tie: probability ~1 at positions 2 and 5
        block[1, :, 3] = 0.0
        block[1, 4, :] = 0.0  # uniform: confidence exactly 1/16
        block = block.to(dtype)
        canvas = torch.full((2, 8), 99, dtype=torch.long)
        canvas[:, 0] = 1
        for threshold in (0.0625, 0.5, 1.0):
            c_out = confidence_unmask(block.float(), canvas, 99, threshold)
            d_out = confidence_unmask(block.to(device).float(), canvas.to(device), 99, threshold)
            assert all(torch.equal(a, b.cpu()) for a, b in zip(c_out, d_out)), \
                f"unmask {name} threshold {threshold}"

        # penalties per verify row (the accepted drafts before a row count as output)
        verify = torch.randn(2, 4, 64, generator=gen).to(dtype).float()
        verify_drafts = torch.randint(0, 64, (2, 3), generator=gen)
        penalties = [RequestPenalties(repetition=1.3, frequency=0.2, presence=0.1,
                                      logit_bias={5: 2.0}),
                     RequestPenalties(min_new_tokens=8, stop_token_ids=frozenset({7}))]
        histories = [[3, 5, 5], [1]]
        c_pen = apply_penalties_per_row(verify.clone(), verify_drafts, histories, penalties)
        d_pen = apply_penalties_per_row(verify.to(device), verify_drafts.to(device), histories,
                                        penalties)
        assert torch.allclose(c_pen, d_pen.cpu(), atol=1e-5, rtol=1e-5), f"penalties {name}"
        assert torch.equal(c_pen.argmax(-1), d_pen.argmax(-1).cpu()), f"penalty argmax {name}"

        # slots: plan scores with a tie, a score at the threshold, verify runs
        first = torch.randn(6, 64, generator=gen).to(dtype)
        first[4] = first[1]  # tie between slots 1 and 4
        masked = torch.tensor([True, True, False, True, True, True])
        c_scores, c_tokens = score_slots(first, masked)
        d_scores, d_tokens = score_slots(first.to(device), masked.to(device))
        assert torch.equal(c_tokens, d_tokens.cpu()), f"slot tokens {name}"
        for threshold in (float(c_scores[1]), 0.99):
            assert torch.equal(select_slots(c_scores, threshold),
                               select_slots(c_scores.to(device), threshold).cpu()), \
                f"select_slots {name}"
        probs = torch.rand(5, 6, generator=gen).to(dtype).float()
        probs[0, 3] = 0.4  # exactly the threshold: not accepted
        ids = torch.randint(0, 64, (5, 6), generator=gen)
        ids[2, 4:] = -1
        assert torch.equal(verify_slot_drafts(ids, probs, 0.4),
                           verify_slot_drafts(ids.to(device), probs.to(device), 0.4).cpu()), \
            f"verify_slot_drafts {name}"
    for prefix, n, k in ((0, 0, 4), (5, 3, 4), (17, 7, 8)):
        c_mask, c_pos = quadratic_mask(prefix, n, k)
        d_mask, d_pos = quadratic_mask(prefix, n, k, device=device)
        assert torch.equal(c_mask, d_mask.cpu()) and torch.equal(c_pos, d_pos.cpu())
    assert torch.equal(block_causal_mask(24, 8), block_causal_mask(24, 8).to(device).cpu())
    figures["cases"] = "greedy, coupled, unmask x3 thresholds, penalties, slots; fp32, bf16"
    return figures


# ----------------------------------------------------------------------------- TiDAR split


def _attend(q, k, v, mask):  # q [T, H, D], k/v [S, H, D], mask [T, S] bool
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


class _PagedSDPA:
    """Stands in for a vLLM attention layer and its backend kernel (the one part of the
    TiDAR schedule this check does not run): writes the call's K/V into the paged cache at
    the forward context's slot mapping, then attends each request's query rows over its
    slots as the context's metadata lists them (causal from an offset, or not at all)."""

    layer_name = "layer.0"

    def __init__(self, k_cache, v_cache, heads: int, dim: int, context) -> None:
        self.k_cache, self.v_cache, self.context = k_cache, v_cache, context
        self.num_heads = self.num_kv_heads = heads
        self.head_size = self.head_size_v = dim

    def __call__(self, query, key, value):
        name, shape = self.layer_name, (-1, self.num_heads, self.head_size)
        self.update(key.view(shape), value.view(shape), name)
        out = torch.empty(query.shape[0], self.num_heads, self.head_size,
                          dtype=query.dtype, device=query.device)
        q = query.view(shape)
        for rows, seen, offset in self.context.attn_metadata[name]:
            mask = None if offset is None else torch.ones(
                rows.stop - rows.start, len(seen), dtype=torch.bool, device=q.device).tril(offset)
            out[rows] = _attend(q[rows], self.k_cache[seen], self.v_cache[seen], mask)
        return out.view(query.shape[0], -1)

    def update(self, key, value, name) -> None:  # vLLM's unified_kv_cache_update
        slots = self.context.slot_mapping[name]
        self.k_cache[slots], self.v_cache[slots] = key, value


def _vllm_stand_ins(layer: _PagedSDPA):
    """The two vLLM names ``_QuadraticAttention.forward`` imports (its forward context and
    KV-cache write), as modules in ``sys.modules`` for the duration of a call: this
    check needs no vLLM."""
    import types
    from unittest import mock

    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.get_forward_context = lambda: layer.context
    attention = types.ModuleType("vllm.model_executor.layers.attention.attention")
    attention.unified_kv_cache_update = layer.update
    modules = {"vllm.forward_context": forward_context,
               "vllm.model_executor.layers.attention.attention": attention}
    for parent in ("vllm", "vllm.model_executor", "vllm.model_executor.layers",
                   "vllm.model_executor.layers.attention"):
        if parent not in sys.modules:
            modules[parent] = types.ModuleType(parent)
    return mock.patch.dict(sys.modules, modules)


def check_tidar_split_attention(device: torch.device, quick: bool) -> dict:
    """vLLM TiDAR's attention schedule, run by diffspec's own code: the branch layout and
    order of ``tidar.build_branches`` and ``_QuadraticAttention.forward``
    (diffspec/spec_workers/vllm/tidar.py: the runner's causal verify, the branches
    ``a = n .. 0`` with their metadata and slot mappings swapped in, the verify K/V of
    ``d_1 .. d_n`` written back), over one paged cache shared by several requests in one
    forward, against one dense attention per request under the quadratic mask. Stood in:
    the backend's metadata (``non_causal_blocks``, built here from the block tables) and its
    kernel (:class:`_PagedSDPA`); a GPU engine run checks those."""
    from types import SimpleNamespace

    import numpy as np

    from diffspec.core.masks import quadratic_mask
    from diffspec.spec_workers.vllm import proposer, tidar

    gen = torch.Generator().manual_seed(1)
    heads, dim, page = 4, 32, 16
    figures: dict = {}
    for name, dtype in DTYPES.items():
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        # requests: (committed context C, drafts n, masks per branch K)
        requests = [(37, 3, 4), (5, 0, 4), (64, 7, 8)] if quick else \
            [(37, 3, 4), (5, 0, 4), (64, 7, 8), (1000, 7, 8), (4090, 15, 16)]
        num_pages = sum((c + n + 1 + k) // page + 2 for c, n, k in requests) + 3
        k_cache = torch.randn(num_pages * page, heads, dim, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(num_pages * page, heads, dim, generator=gen).to(dtype).to(device)
        pages = torch.randperm(num_pages, generator=gen).tolist()
        tables = []
        for c, n, k in requests:
            need = (c + n + 1 + k + page - 1) // page
            tables.append(torch.tensor(pages[:need]))
            pages = pages[need:]
        untouched = torch.tensor(pages) if pages else torch.tensor([], dtype=torch.long)

        def slots(row, positions):  # pool slots of request ``row``'s positions
            positions = torch.as_tensor(positions)
            return (tables[row][positions // page] * page + positions % page).to(device)

        # the runner's verify layout (request by request) and the step's plans
        verify_lens = [n + 1 for _, n, _ in requests]
        query_start = np.concatenate([[0], np.cumsum(verify_lens)]).astype(np.int32)
        num_verify = int(query_start[-1])
        plans = [tidar.BranchPlan(row=r, anchor=c, num_drafts=n, num_masks=k)
                 for r, (c, n, k) in enumerate(requests)]

        def blocks(runner, rows, starts, lengths, method):  # the backend's metadata
            bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            meta = [(slice(int(bounds[i]), int(bounds[i + 1])),
                     slots(row, range(start + int(lengths[i]))), None)
                    for i, (row, start) in enumerate(zip(rows, starts))]
            positions = torch.cat([torch.arange(s, s + int(n)) for s, n in zip(starts, lengths)])
            mapping = torch.cat([slots(row, range(s, s + int(n)))
                                 for row, s, n in zip(rows, starts, lengths)])
            return proposer.NonCausalBlocks({_PagedSDPA.layer_name: meta}, mapping,
                                            positions.to(device), bounds)

        branches = tidar.build_branches(
            plans, lambda rows, starts, lengths: blocks(None, rows, starts, lengths, "tidar"),
            query_start, 0, device)
        total = num_verify + len(branches.positions)
        q, kk, vv = (torch.randn(total, heads * dim, generator=gen).to(dtype).to(device)
                     for _ in range(3))

        def rows_of(r):  # request r's rows of the forward, in the quadratic mask's order
            c, n, k = requests[r]
            verify = list(range(query_start[r], query_start[r + 1]))
            return verify + [num_verify + branches.offsets[(r, a)] + i
                             for a in range(n + 1) for i in range(k)]

        before = (k_cache.clone(), v_cache.clone())
        dense = []
        for r, (c, n, k) in enumerate(requests):
            mask, _ = quadratic_mask(c, n, k, device=device)
            index, prefix = torch.tensor(rows_of(r), device=device), slots(r, range(c))
            keys = torch.cat([k_cache[prefix], kk[index].view(-1, heads, dim)])
            values = torch.cat([v_cache[prefix], vv[index].view(-1, heads, dim)])
            dense.append(_attend(q[index].view(-1, heads, dim), keys, values, mask))
        # the verify: causal over each request's cache and its own tokens
        context = SimpleNamespace(
            attn_metadata={_PagedSDPA.layer_name: [
                (slice(int(query_start[r]), int(query_start[r + 1])),
                 slots(r, range(c + n + 1)), c) for r, (c, n, _) in enumerate(requests)]},
            slot_mapping={_PagedSDPA.layer_name: torch.cat(
                [slots(r, range(c, c + n + 1)) for r, (c, n, _) in enumerate(requests)])})
        layer = _PagedSDPA(k_cache, v_cache, heads, dim, context)
        with _vllm_stand_ins(layer):
            out = tidar._QuadraticAttention(layer, num_verify, branches).forward(q, kk, vv)
        worst = 0.0
        for r, (c, n, k) in enumerate(requests):
            split = out[torch.tensor(rows_of(r), device=device)].view(-1, heads, dim)
            err = float((split.float() - dense[r].float()).abs().max())
            worst = max(worst, err)
            assert err <= tol, f"{name} request {r}: split vs dense max error {err}"
            # the cache: prefix untouched, verify tokens in their slots (as a plain verify)
            prefix, verify = slots(r, range(c)), slots(r, range(c, c + n + 1))
            assert torch.equal(k_cache[prefix], before[0][prefix])
            rows = slice(int(query_start[r]), int(query_start[r + 1]))
            assert torch.equal(k_cache[verify], kk[rows].view(-1, heads, dim)), \
                f"{name} request {r}: the verify K/V are not in their slots after the step"
        if len(untouched):  # pages of no request: never written
            free = torch.cat([torch.arange(p * page, (p + 1) * page) for p in untouched.tolist()])
            assert torch.equal(k_cache[free.to(device)], before[0][free.to(device)])
        figures[name] = {"requests": requests, "max_abs_error": worst, "tolerance": tol,
                         "ran": "diffspec's tidar.build_branches and "
                                "_QuadraticAttention.forward; stood in: backend metadata "
                                "and kernel (paged SDPA)"}
    return figures


# ----------------------------------------------------------------------------- decoders


DECODERS = ("orthrus", "linear_self_spec", "tidar", "fast_dllm", "refusion")


TEXTS = ("the cat sat on the", "one two three four five", "a")


def _decode(method: str, dtype: torch.dtype, device: torch.device, max_tokens: int):
    """Greedy outputs of ``method``'s reference decoder on its bundled model, built and run
    under ``device`` (weights and every tensor the decoder makes)."""
    from diffspec.cli import bundled_model_path
    from diffspec.core.sampling import SamplingParams
    from diffspec.spec_workers.reference import load_decoder
    from diffspec.spec_workers.reference.decoder import Request

    with torch.device(device):
        decoder = load_decoder(method, bundled_model_path(method), dtype=dtype)
        prompts = [decoder.tokenizer(t, add_special_tokens=False)["input_ids"] or [1]
                   for t in TEXTS]
        requests = [Request(p, max_tokens=max_tokens, sampling=SamplingParams())
                    for p in prompts]  # no stop tokens: every request runs max_tokens
        return [list(o.token_ids) for o in decoder.decode(requests)]


def check_decoders_bf16(device: torch.device, quick: bool) -> dict:
    figures: dict = {}
    methods = DECODERS[:2] if quick else DECODERS
    for method in methods:
        max_tokens = 16 if quick else 32
        cpu32 = _decode(method, torch.float32, torch.device("cpu"), max_tokens)
        dev32 = _decode(method, torch.float32, device, max_tokens)
        dev16 = _decode(method, torch.bfloat16, device, max_tokens)
        assert dev32 == cpu32, f"{method}: fp32 on {device} differs from fp32 on CPU"
        same = total = 0
        for a, b in zip(dev16, dev32):
            prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same, total = same + prefix, total + len(b)
        rate = same / max(total, 1)
        figures[method] = {"fp32_equals_cpu": True, "bf16_prefix_match": round(rate, 4),
                           "tokens": total}
        # bf16 is not promised exact; a broken bf16 path produces garbage from the start
        assert rate >= 0.25, f"{method}: bf16 matches fp32 on only {rate:.0%} of tokens"
    return figures


# ----------------------------------------------------------------------------- logits memory


def check_draft_logits_memory(device: torch.device, quick: bool) -> dict:
    """Logits of ``rows`` draft rows at Qwen3-8B's vocabulary, whole vs in 1024-row chunks
    (what bounding the draft passes' logits buffers saves; issue 29 row 8)."""
    hidden, vocab = (256, 4096) if quick else (4096, 151936)
    rows = 2048 if quick else 8192
    chunk = 1024
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype).to(device)
    states = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    cuda = device.type == "cuda"

    def peak(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
            return out, torch.cuda.max_memory_allocated() - base
        return out, None

    whole, whole_bytes = peak(lambda: (states @ weight.T).argmax(-1))
    chunked, chunk_bytes = peak(lambda: torch.cat(
        [(states[i:i + chunk] @ weight.T).argmax(-1) for i in range(0, rows, chunk)]))
    assert torch.equal(whole, chunked), "chunked drafts differ from whole-batch drafts"
    element = torch.finfo(dtype).bits // 8
    figures = {"rows": rows, "vocab": vocab, "chunk_rows": chunk,
               "logits_bytes_whole": rows * vocab * element,
               "logits_bytes_chunk": chunk * vocab * element,
               "peak_bytes_whole": whole_bytes, "peak_bytes_chunked": chunk_bytes}
    if cuda:
        assert chunk_bytes < whole_bytes, "chunking did not lower the peak"
    return figures


# ----------------------------------------------------------------------------- MaskedAttention


class _Pool:  # the KV pool's read side, as MaskedAttention reads it
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_masked_attention(device: torch.device, quick: bool) -> dict:
    """SGLang TIDAR's ``MaskedAttention`` (diffspec/model_executors/sglang/quadratic.py;
    SGLang itself is not needed with ``save_kv_cache=False``) at Qwen3-8B's heads (32 query,
    8 KV, head_dim 128) on a random paged pool, 4 requests of one decode step each ((n + 1)(1
    + K') = 81 tokens, n = 8) at 1k, 2k, 4k and 8k context: its output equals a dense fp32
    attention under the same masks (within the dtype's tolerance), its time per call, and
    (CUDA) its peak memory, which must stay under the per-request working set bound: the
    request's gathered K/V (twice: the pool read and the concatenation), its fp32 scores
    and boolean mask, and the output."""
    from types import SimpleNamespace

    from diffspec.model_executors.sglang.quadratic import (
        MaskedAttention,
        MaskedLayout,
        verify_step_layout,
    )

    hq, hkv, dim = (8, 2, 64) if quick else (32, 8, 128)
    contexts = (256, 512) if quick else (1024, 2048, 4096, 8192)
    n, masks, reqs = 8, 8, 4
    new_mask, _ = verify_step_layout(n, masks, device)  # [T, T]
    t = new_mask.shape[0]
    gen = torch.Generator().manual_seed(3)
    layer = SimpleNamespace(tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv,
                            qk_head_dim=dim, v_head_dim=dim, scaling=dim ** -0.5, layer_id=0,
                            sliding_window_size=None, logit_cap=0)
    cuda = device.type == "cuda"
    figures: dict = {"heads": [hq, hkv, dim], "tokens_per_request": t, "requests": reqs}
    for name, dtype in DTYPES.items():
        tol = 2e-4 if dtype == torch.float32 else 3e-2
        rows = []
        for context in contexts:
            slots_total = reqs * context + 64
            k_pool = torch.randn(slots_total, hkv, dim, generator=gen).to(dtype).to(device)
            v_pool = torch.randn(slots_total, hkv, dim, generator=gen).to(dtype).to(device)
            perm = torch.randperm(slots_total, generator=gen).to(device)
            prefix = [perm[r * context:(r + 1) * context] for r in range(reqs)]
            masks = [torch.cat([torch.ones(t, context, dtype=torch.bool, device=device),
                                new_mask], dim=1) for _ in range(reqs)]  # [T, C + T]
            layout = MaskedLayout(
                query_rows=[torch.arange(r * t, (r + 1) * t, device=device) for r in range(reqs)],
                prefix_slots=prefix, masks=list(masks))
            backend = SimpleNamespace(token_to_kv_pool=_Pool(k_pool, v_pool))
            attention = MaskedAttention(backend, layout)
            q = torch.randn(reqs * t, hq * dim, generator=gen).to(dtype).to(device)
            k = torch.randn(reqs * t, hkv * dim, generator=gen).to(dtype).to(device)
            v = torch.randn(reqs * t, hkv * dim, generator=gen).to(dtype).to(device)
            call = lambda: attention.forward(q, k, v, layer, None, save_kv_cache=False)  # noqa: E731
            call()  # warm-up
            _sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            out = call()
            _sync(device)
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
            # dense fp32 reference, per request, the masks explicit
            worst = 0.0
            for r in range(reqs):
                qs = q[r * t:(r + 1) * t].float().view(t, hq, dim).transpose(0, 1)
                keys = torch.cat([k_pool[prefix[r]].float(),
                                  k[r * t:(r + 1) * t].float().view(t, hkv, dim)])
                values = torch.cat([v_pool[prefix[r]].float(),
                                    v[r * t:(r + 1) * t].float().view(t, hkv, dim)])
                keys = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [Hq, S, D]
                values = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
                scores = (qs @ keys.transpose(1, 2)) * layer.scaling  # [Hq, T, S]
                scores = scores.masked_fill(~masks[r][None], float("-inf"))
                dense = (scores.softmax(-1) @ values).transpose(0, 1).reshape(t, hq * dim)
                err = float((out[r * t:(r + 1) * t].float() - dense).abs().max())
                worst = max(worst, err)
            assert worst <= tol, f"{name} context {context}: max error {worst} > {tol}"
            # one request's working set (the requests run one after the other): its K/V
            # gathered from the pool, concatenated with the step's and expanded to the
            # query heads (SDPA's math kernel under a mask), its scores and probabilities
            # in fp32 and the dtype, the boolean mask and its additive form; then the
            # output of every request, and 16 MiB for the kernels' workspaces
            element = torch.finfo(dtype).bits // 8
            keys = context + t
            keys_bytes = keys * hkv * dim * element * 2  # K and V of one request
            bound = ((2 + hq // hkv) * keys_bytes + hq * t * keys * (4 + 4 + element)
                     + t * keys * (1 + 4) + reqs * t * hq * dim * element * 2 + (16 << 20))
            if cuda:
                assert peak <= bound, f"{name} context {context}: peak {peak} > bound {bound}"
            rows.append({"context": context, "ms": round(seconds * 1e3, 3),
                         "peak_bytes": peak, "bound_bytes": bound, "max_abs_error": worst})
        figures[name] = {"tolerance": tol, "contexts": rows}
    if not cuda:
        figures["memory"] = "not measured: CUDA's allocator statistics only"
    return figures


# ----------------------------------------------------------------------------- draft pass


class _DraftPass:
    """A draft pass at a Qwen3 shape with random weights, in plain torch: ``layers``
    Qwen3 layers (RMSNorm, q/k norms, RoPE, attention over the request's cached prefix K/V
    and its block, non-causally, SwiGLU MLP), the final norm and the LM head's argmax in
    chunks of ``chunk`` rows (``None``: all rows at once). Static shapes, no host sync:
    CUDA-graph capturable."""

    def __init__(self, shape: dict, reqs: int, width: int, context: int,
                 device: torch.device, dtype: torch.dtype, seed: int = 4) -> None:
        gen = torch.Generator().manual_seed(seed)
        h, hq, hkv, d = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.shape, self.reqs, self.width, self.context = shape, reqs, width, context

        def w(*size, scale=0.02):
            return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

        self.layers = [{
            "qkv": w((hq + 2 * hkv) * d, h), "o": w(h, hq * d), "gate_up": w(
                2 * shape["intermediate"], h), "down": w(h, shape["intermediate"]),
            "k_cache": w(reqs, hkv, context, d, scale=1.0),
            "v_cache": w(reqs, hkv, context, d, scale=1.0),
        } for _ in range(shape["layers"])]
        self.head = w(shape["vocab"], h)
        positions = context + torch.arange(width)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
        angles = positions[:, None].float() * inv[None]  # [W, D / 2]
        self.cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)  # [W, D]
        self.sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
        self.hidden_in = w(reqs * width, h, scale=1.0)  # the block's embeddings

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                ).to(x.dtype)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, W, D]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * self.cos + rotated * self.sin

    def hidden(self, x: torch.Tensor) -> torch.Tensor:  # [B * W, hidden] -> same
        s = self.shape
        b, wd, hq, hkv, d = self.reqs, self.width, s["heads"], s["kv_heads"], s["head_dim"]
        for layer in self.layers:
            qkv = self._norm(x) @ layer["qkv"].T
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
            q = self._rope(self._norm(q.view(b, wd, hq, d)).transpose(1, 2))  # [B, Hq, W, D]
            k = self._rope(self._norm(k.view(b, wd, hkv, d)).transpose(1, 2))
            v = v.view(b, wd, hkv, d).transpose(1, 2)
            keys = torch.cat([layer["k_cache"], k], 2)  # [B, Hkv, C + W, D]
            values = torch.cat([layer["v_cache"], v], 2)
            att = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, enable_gqa=True)  # non-causal: the whole block sees itself
            x = x + att.transpose(1, 2).reshape(b * wd, hq * d) @ layer["o"].T
            gate, up = (self._norm(x) @ layer["gate_up"].T).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ layer["down"].T
        return self._norm(x)

    def drafts(self, hidden: torch.Tensor, chunk: int | None) -> torch.Tensor:  # [B * W]
        chunk = hidden.shape[0] if chunk is None else chunk
        return torch.cat([(hidden[i:i + chunk] @ self.head.T).float().argmax(-1)
                          for i in range(0, hidden.shape[0], chunk)])


QWEN3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "intermediate": 12288, "vocab": 151936, "layers": 2}
QUICK_SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64,
               "intermediate": 512, "vocab": 4096, "layers": 2}


def check_draft_pass(device: torch.device, quick: bool) -> dict:
    """The draft pass at Qwen3-8B's shape (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
    vocabulary 151936; 2 layers, random bf16 weights): 64 requests' 32-token blocks over
    1024 cached tokens each (2048 draft rows, twice the 1024-row chunk). Eager vs a CUDA
    graph of the same pass (``torch.cuda.graphs``; skipped on CPU with the reason): the
    graph's hidden states equal eager's within bf16 tolerance and its drafts are eager's;
    the times of both. The LM head's argmax whole vs in chunks of
    :data:`~diffspec.spec_workers.vllm.proposer.DRAFT_LOGITS_ROWS` (the vLLM proposers'
    ``draft_argmax``, run here): the same drafts, and (CUDA) the chunked peak under
    ``chunk x vocab`` bf16 logits plus their fp32 argmax input, below the whole one."""
    from diffspec.spec_workers.vllm.proposer import DRAFT_LOGITS_ROWS, draft_argmax

    shape = QUICK_SHAPE if quick else QWEN3_8B
    reqs, width, context = (8, 16, 64) if quick else (64, 32, 1024)
    chunk = 32 if quick else DRAFT_LOGITS_ROWS
    dtype = torch.bfloat16
    cuda = device.type == "cuda"
    net = _DraftPass(shape, reqs, width, context, device, dtype)
    rows = reqs * width
    figures: dict = {"shape": shape, "requests": reqs, "block": width, "context": context,
                     "rows": rows, "chunk_rows": chunk}

    def timed(fn: Callable[[], torch.Tensor], repeats: int = 3) -> tuple[torch.Tensor, float]:
        out = fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        _sync(device)
        return out, (time.perf_counter() - start) / repeats

    with torch.inference_mode():
        hidden, eager_s = timed(lambda: net.hidden(net.hidden_in))
        drafts = net.drafts(hidden, chunk)
        figures["eager_ms"] = round(eager_s * 1e3, 3)
        if cuda:
            static_in = net.hidden_in.clone()
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up outside the capture
                for _ in range(2):
                    net.drafts(net.hidden(static_in), chunk)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_hidden = net.hidden(static_in)
                static_drafts = net.drafts(static_hidden, chunk)
            _, graph_s = timed(lambda: graph.replay() or static_hidden)
            static_in.copy_(net.hidden_in)
            graph.replay()
            _sync(device)
            err = float((static_hidden.float() - hidden.float()).abs().max())
            scale = float(hidden.float().abs().max())
            same = float((static_drafts == drafts).float().mean())
            assert err <= 1e-2 * max(scale, 1.0), f"graph vs eager hidden: max error {err}"
            assert same >= 0.99, f"graph vs eager drafts: {same:.2%} equal"
            figures["graph"] = {"ms": round(graph_s * 1e3, 3), "max_abs_error": err,
                                "drafts_equal": same}
        else:
            figures["graph"] = "skipped: CUDA graphs need a CUDA device"

        # the LM head's logits: whole vs chunked (vLLM's draft_argmax), peak memory
        model = type("Head", (), {"compute_logits": staticmethod(
            lambda h: (h @ net.head.T).float())})
        index = torch.arange(rows, device=device)

        def peak(fn: Callable[[], object]) -> tuple[object, int | None]:
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            out = fn()
            if cuda:
                torch.cuda.synchronize(device)
                return out, torch.cuda.max_memory_allocated(device) - base
            return out, None

        whole, whole_bytes = peak(lambda: draft_argmax(model, hidden, index, chunk=rows))
        chunked, chunk_bytes = peak(lambda: draft_argmax(model, hidden, index, chunk=chunk))
        assert whole == chunked == drafts.tolist(), "chunked drafts differ from whole drafts"
        vocab = shape["vocab"]
        # a chunk's bf16 logits and their fp32 copy, the gathered hidden rows, the drafts,
        # and 64 MiB for cuBLAS's workspace
        bound = chunk * vocab * (2 + 4) + rows * shape["hidden"] * 2 + rows * 8 + (64 << 20)
        figures["logits"] = {"peak_bytes_whole": whole_bytes, "peak_bytes_chunked": chunk_bytes,
                             "bound_bytes_chunked": bound,
                             "logits_bytes_whole_fp32": rows * vocab * 4}
        if cuda:
            assert chunk_bytes <= bound, f"chunked head peak {chunk_bytes} > bound {bound}"
            assert chunk_bytes < whole_bytes, "chunking did not lower the peak"
        else:
            figures["logits"]["memory"] = "not measured: CUDA's allocator statistics only"
    return figures


CHECKS: dict[str, Callable[[torch.device, bool], dict]] = {
    "core_rules": check_core_rules,
    "tidar_split_attention": check_tidar_split_attention,
    "decoders_bf16": check_decoders_bf16,
    "draft_logits_memory": check_draft_logits_memory,
    "masked_attention": check_masked_attention,
    "draft_pass": check_draft_pass,
}


def run(device: str, quick: bool, only: list[str] | None = None) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available (use --device cpu to test the "
                         "check itself)")
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "python": platform.python_version(),
              "quick": quick, "checks": {}}
    for name, check in CHECKS.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        try:
            figures, error = check(dev, quick), None
        except Exception as exc:  # noqa: BLE001 - recorded, the command fails at the end
            figures, error = {}, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        report["checks"][name] = {"ok": error is None, "seconds": round(
            time.perf_counter() - start, 2), "figures": figures, "error": error}
        print(f"[gpu_check] {name}: {'ok' if error is None else 'FAILED'} "
              f"({report['checks'][name]['seconds']} s)", flush=True)
        if error:
            print(error, file=sys.stderr, flush=True)
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", default="gpu-check.json", help="where the figures go")
    parser.add_argument("--quick", action="store_true", help="small shapes (the CPU test)")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks")
    args = parser.parse_args(argv)
    report = run(args.device, args.quick, args.only)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"[gpu_check] {'ok' if report['ok'] else 'FAILED'}; figures in {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
