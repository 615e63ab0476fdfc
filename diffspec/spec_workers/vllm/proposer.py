"""What diffspec's vLLM proposers share (the two-pass drafter of
:mod:`~diffspec.spec_workers.vllm.two_pass` and TiDAR's one-forward step of
:mod:`~diffspec.spec_workers.vllm.tidar`): attention metadata for query blocks that attend
non-causally to their request's paged K/V (built by the target's own attention backend), the
adaptive draft-count policy from the speculative config and the latency profile it prices
steps with (:func:`measure_profile`: the runner's own forwards, timed at start-up by the
``warm_up_profile`` patch, cached), and host-to-device copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level

__all__ = ["DRAFT_LOGITS_ROWS", "NonCausalBlocks", "adaptive_policy",
           "draft_argmax", "logger", "measure_profile", "non_causal_blocks",
           "non_causal_metadata", "on_device", "one_kv_cache_group", "prompt_lookup",
           "seeded_requests"]

PROFILE_CONTEXT = 256  # context tokens per request in the start-up profile's forwards

# Rows of draft logits a proposer materialises at once. vLLM's memory profile (a dummy
# forward of max_num_batched_tokens) does not see the drafts' logits; whole, they would be
# up to max_num_batched_tokens x vocab (8192 x 151936 in bf16: 2.5 GB at Qwen3's
# vocabulary); in chunks they are at most this many rows (1024 x 151936: 311 MB).
DRAFT_LOGITS_ROWS = 1024


@dataclass
class NonCausalBlocks:
    """Query blocks that attend non-causally to their request's paged K/V and to
    themselves: per-layer attention metadata built by the target's own backend."""

    attn_metadata: dict[str, object]  # layer name -> the backend's metadata
    slot_mapping: torch.Tensor  # [T] the slots the blocks' K/V are written to
    positions: torch.Tensor  # [T] on the device
    query_start: np.ndarray  # [B + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])


def non_causal_blocks(
    runner,
    rows: list[int],  # [B] each block's request row in the runner's input batch
    starts: list[int],  # [B] position of each block's first token
    lengths: np.ndarray,  # [B] tokens per block
    method: str,
) -> NonCausalBlocks:
    """:func:`non_causal_metadata` for blocks of the V1 runner's input batch rows ``rows``."""
    groups = one_kv_cache_group(runner.attn_groups, method)
    table = runner.input_batch.block_table[0]
    tables = table.get_device_tensor(runner.input_batch.num_reqs)[
        on_device(runner, np.asarray(rows, dtype=np.int64))]
    return non_causal_metadata(groups, tables, table.block_size, starts, lengths, method,
                               runner.device)


def one_kv_cache_group(attn_groups: list, method: str) -> list:
    """The attention groups of the runner's one KV cache group (``attn_groups[0]``, V1 and
    V2 runners alike); a ``RuntimeError`` for a model with more (not full attention in
    every layer), which ``method``'s non-causal blocks cannot attend over."""
    if len(attn_groups) != 1:
        raise RuntimeError(f"method {method!r} supports models with one KV cache group (full "
                           f"attention in every layer); this one has {len(attn_groups)}")
    return attn_groups[0]


def non_causal_metadata(
    groups: list,  # the attention groups of the model's one KV cache group
    tables: torch.Tensor,  # [B, max blocks] each block's request's block table, on the device
    page: int,  # tokens per KV block
    starts: list[int],  # [B] position of each block's first token
    lengths: np.ndarray,  # [B] tokens per block
    method: str,
    device,
) -> NonCausalBlocks:
    """Attention metadata for blocks ``starts[i] .. starts[i] + lengths[i] - 1`` whose
    requests have block tables ``tables[i]``: each block sees its request's K/V of positions
    ``0 .. starts[i] - 1`` (the paged cache) and itself, non-causally; its K/V go to the
    slots of its own positions. Built by the target's own attention builders (the V1 and V2
    runners' groups alike); refuses a backend that stays causal."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_start = np.zeros(len(starts) + 1, dtype=np.int32)  # [B + 1]
    np.cumsum(lengths, out=query_start[1:])
    positions = torch.from_numpy(np.concatenate(
        [np.arange(s, s + n) for s, n in zip(starts, lengths)])).to(device)  # [T]
    token_rows = torch.from_numpy(np.repeat(np.arange(len(starts)), lengths)).to(device)
    pages = tables[token_rows, positions // page].to(torch.int64)  # [T]
    slot_mapping = pages * page + positions % page  # [T]
    seq_lens = (np.asarray(starts) + lengths).astype(np.int32)  # [B]
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start).to(device),
        query_start_loc_cpu=torch.from_numpy(query_start),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
        num_reqs=len(starts),
        num_actual_tokens=int(query_start[-1]),
        max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=tables,
        slot_mapping=slot_mapping,
        causal=False,
        positions=positions,
    )
    per_layer = {}
    for group in groups:
        metadata = group.build_metadata_for_drafting(common, draft_index=0)
        if getattr(metadata, "causal", None) is not False:
            raise RuntimeError(
                f"attention backend {group.backend.get_name()} cannot attend non-causally "
                f"over the paged KV cache, which method {method!r} drafts with; pick one "
                f"that can (--attention-backend TRITON_ATTN on GPU, CPU_ATTN on CPU)")
        per_layer.update(dict.fromkeys(group.layer_names, metadata))
    return NonCausalBlocks(per_layer, slot_mapping, positions, query_start)


def draft_argmax(model, hidden: torch.Tensor, rows: torch.Tensor,
                 chunk: int = DRAFT_LOGITS_ROWS) -> list[int] | None:
    """The argmax token of ``model.compute_logits`` at ``hidden[rows]`` (``rows``: [R]
    indices), computed ``chunk`` rows at a time (:data:`DRAFT_LOGITS_ROWS`); ``None`` on a
    tensor-parallel rank that does not hold the gathered logits."""
    tokens = []
    for start in range(0, rows.numel(), chunk):
        logits = model.compute_logits(hidden[rows[start:start + chunk]])  # [<= chunk, vocab]
        if logits is None:
            return None
        tokens.append(logits.argmax(dim=-1))
    return torch.cat(tokens).tolist() if tokens else []


def on_device(runner, array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor on the runner's device (a non-blocking copy)."""
    return torch.from_numpy(array).to(runner.device, non_blocking=True)


def adaptive_policy(vllm_config, max_drafts: int, cost):
    """The adaptive draft-count policy of the speculative config (``"adaptive"``, true
    unless the user set it false; moved to ``additional_config["diffspec"]`` by the config
    translation), or ``None`` for a fixed draft count. With ``"latency_profile": PATH`` it
    prices steps from that file, as is; otherwise its profile is measured at start-up
    (:func:`measure_profile`) and step times are tracked online (one tensor-parallel rank
    alone: wall times differ between ranks, which must choose alike). Its acceptance
    estimate starts from the checkpoint's measured acceptance where config.json has one
    (:func:`~diffspec.core.adaptive.checkpoint_prior`); ``"carry"`` (default ``"auto"``;
    ``"off"`` with tensor parallelism) says whether it over-drafts for carried drafts.
    ``cost``: a :class:`~diffspec.core.adaptive.StepCost` or its kind."""
    import json
    from pathlib import Path

    from diffspec.core.adaptive import (
        AdaptiveDrafts,
        StepCost,
        checkpoint_prior,
        load_latency_profile,
    )

    options = (getattr(vllm_config, "additional_config", None) or {}).get("diffspec") or {}
    if not options.get("adaptive", True):
        return None
    cost = StepCost(cost) if isinstance(cost, str) else cost
    tp = vllm_config.parallel_config.tensor_parallel_size
    carry = options.get("carry", "auto")
    if tp > 1 and carry != "off":
        # the drafts' argmax is on the first rank alone; every rank must run the same
        # draft forwards, so no rank may skip one for drafts the others do not hold
        logger.info("diffspec: carried drafts off with tensor parallelism (%d ranks)", tp)
        carry = "off"
    prior = checkpoint_prior(vllm_config.model_config.hf_config)
    if prior:
        logger.info("diffspec: adaptive drafts start from the checkpoint's measured acceptance "
                    "(drafts 1-4: %s)", ", ".join(f"{a:.2f}" for a in prior[:4]))
    path = options.get("latency_profile")
    if path:
        profile = load_latency_profile(json.loads(Path(path).read_text()))
        logger.info("diffspec: adaptive draft counts (at most %d per request) from the latency "
                    "profile %s", max_drafts, path)
        return AdaptiveDrafts(max_drafts, profile, cost, draft_prior=prior, carry=carry)
    return AdaptiveDrafts(max_drafts, None, cost, track_step_times=tp == 1, draft_prior=prior,
                          carry=carry)


def seeded_requests(runner, req_ids) -> list[bool]:
    """Per request of ``req_ids``, whether it samples with its own seed (vLLM's per-request
    generator): the adaptive policy then drafts it by its own history alone
    (:class:`~diffspec.core.adaptive.AdaptiveDrafts`), so the same seeded request gives
    the same samples every time. Greedy requests are exact whatever their drafts."""
    flags = []
    for req_id in req_ids:
        params = getattr(runner.requests[req_id], "sampling_params", None)
        flags.append(params is not None and getattr(params, "seed", None) is not None
                     and float(getattr(params, "temperature", 0.0) or 0.0) > 1e-5)
    return flags


def prompt_lookup(vllm_config, method: str):
    """The speculative config's prompt-lookup settings
    (:class:`~diffspec.core.lookup.PromptLookup`, moved to
    ``additional_config["diffspec"]["prompt_lookup"]`` by the config translation, which
    settled the default), or ``None``: off."""
    from diffspec.core.lookup import PromptLookup

    options = (getattr(vllm_config, "additional_config", None) or {}).get("diffspec") or {}
    settings = options.get("prompt_lookup")
    if not settings:
        return None
    logger.info("diffspec: %s drafts by prompt lookup (n-grams of %d..%d tokens) where the "
                "context holds a match, by its diffusion view elsewhere", method,
                settings["min"], settings["max"])
    return PromptLookup(**settings)


def measure_profile(runner, policy, method: str, max_tokens: int) -> None:
    """Give ``policy`` (an :class:`~diffspec.core.adaptive.AdaptiveDrafts` without a
    profile; anything else: nothing to do) the latency profile of ``runner``'s own
    forwards: ``runner._dummy_run(T)`` plus the logits of all ``T`` tokens (a verify
    computes them all; here :data:`DRAFT_LOGITS_ROWS` at a time), for the widths of
    :func:`~diffspec.profiling.profile_grid` up to ``max_tokens`` (what the policy can
    choose, at most the runner's token budget; past the widest timed the profile
    extrapolates), within about ``profiling.PROFILE_BUDGET_S`` seconds. Cached per
    checkpoint, vLLM version, dtype, device, threads, method, drafts and grid
    (:func:`~diffspec.profiling.cached_latency_profile`). Tensor-parallel ranks run the
    forwards together and take rank 0's profile (and its cache decision)."""
    from diffspec.profiling import checkpoint_identity, device_name, engine_profile, profile_grid

    if policy is None or policy.profile is not None:
        return
    import vllm
    from vllm.distributed import get_tp_group

    config = runner.vllm_config
    model_config = config.model_config
    tp = get_tp_group()
    device = torch.device(runner.device)
    max_len, max_seqs = model_config.max_model_len, config.scheduler_config.max_num_seqs
    # a dummy forward of T tokens is min(T, max_num_seqs) requests, the last holding the
    # remainder; each request's context is CONTEXT tokens (or its query, if longer), never
    # past the model's length: vLLM's dummy default (every context = T) reads past a
    # request's block table once T > max_model_len (a segfault in CPU attention)
    grid = [t for t in profile_grid(max(1, min(max_tokens, runner.max_num_tokens)))
            if _dummy_query_len(t, max_seqs) <= max_len]
    key = {
        "engine": "vllm", "engine_version": vllm.__version__, "torch": torch.__version__,
        "checkpoint": checkpoint_identity(model_config.model, model_config.hf_config.to_dict()),
        "dtype": str(model_config.dtype), "quantization": model_config.quantization,
        "device": device_name(device), "threads": torch.get_num_threads(),
        "tensor_parallel": tp.world_size, "enforce_eager": model_config.enforce_eager,
        "method": method, "max_drafts": policy.max_drafts, "grid": grid,
        **profile_settings(config, runner),
    }
    model = runner.get_model()

    @torch.inference_mode()
    def forward(tokens: int) -> None:
        context = min(max_len, max(PROFILE_CONTEXT, _dummy_query_len(tokens, max_seqs)))
        hidden, _ = runner._dummy_run(tokens, force_attention=True, profile_seq_lens=context)
        # the logits of every token, in bounded chunks: a whole [T, vocab] tensor at the
        # widest T would be the largest allocation of start-up, outside vLLM's accounting
        draft_argmax(model, hidden, torch.arange(tokens, device=hidden.device))

    policy.set_profile(engine_profile(key, forward, grid, device, tp,
                                      lambda line: logger.info("%s", line)))


def profile_settings(vllm_config, runner=None) -> dict:
    """What else a step's time depends on, for a cached profile's key: the attention
    backends the runner's layers use (its attention groups; the configured backend,
    global and per KV-cache kind, where the runner has none yet), the CUDA-graph mode and
    the KV-cache dtype. A profile measured under other settings is measured again."""
    backends = sorted({group.backend.get_name()
                       for groups in getattr(runner, "attn_groups", None) or []
                       for group in groups})
    attention = getattr(vllm_config, "attention_config", None)
    if not backends and attention is not None:
        backends = [str(getattr(attention, "backend", None))] + [
            f"{kind}={backend}" for kind, backend
            in sorted((getattr(attention, "backend_per_kind", None) or {}).items())]
    compilation = getattr(vllm_config, "compilation_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return {"attention_backends": backends,
            "cudagraph_mode": str(getattr(compilation, "cudagraph_mode", None)),
            "kv_cache_dtype": str(getattr(cache, "cache_dtype", None))}


def _dummy_query_len(tokens: int, max_seqs: int) -> int:
    """The longest query of vLLM's dummy forward of ``tokens`` tokens (``_dummy_run``:
    ``min(tokens, max_seqs)`` requests of ``tokens // n``, the last with the remainder)."""
    n = max(1, min(tokens, max_seqs))
    return tokens // n + tokens % n
