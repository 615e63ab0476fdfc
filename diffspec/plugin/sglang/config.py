"""SGLang config: the ``CustomSpecAlgo`` subclass (:func:`spec_class`) that answers what
SGLang's scheduler asks of diffspec's speculative algorithms and fixes the server
arguments they need, and :func:`validate_server_args`, which checks a launch against the
served checkpoint (one place, clear errors). The algorithms themselves (names, methods,
architectures, workers) come from the registry (:mod:`diffspec.methods`).

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    require_method,
    validate_block_size,
)
from diffspec.methods import Method, methods_for_engine

logger = logging.getLogger("diffspec")

__all__ = ["VERIFY_BACKENDS", "activation_tokens", "attention_backend_error", "graphs_disabled",
           "graphs_off_message", "self_spec_algorithms", "spec_class", "validate_server_args"]

# Attention backends diffspec's speculative steps run on. A step's verify (and the
# ORTHRUS / LINEAR_SELF_SPEC draft pass) is a TARGET_VERIFY batch whose width varies per
# step (adaptive draft counts, requests near max_new_tokens) and whose mask is its own
# (``NgramVerifyInput(custom_mask=..., draft_token_num=w)``). torch_native runs it as
# decode rows / masked attention (verified on CPU, tests/engine); triton and flashinfer,
# run eagerly, plan it from the verify input's own width and mask (triton_backend.py
# ``_target_verify_num_tokens_per_req`` and the custom mask, flashinfer_backend.py via
# ``NgramVerifyInput.generate_attn_arg_prefill``): reasoned from SGLang 0.5.23's code, see
# docs/gpu-support.md. Every other backend is refused at start: fa3 plans every verify at
# the server's --speculative-num-draft-tokens and ignores the custom mask
# (flashattention_backend.py, init_forward_metadata), the rest are not checked.
VERIFY_BACKENDS = ("torch_native", "triton", "flashinfer")


def self_spec_algorithms() -> dict[str, Method]:
    """diffspec's methods served through ``--speculative-algorithm``, by algorithm name."""
    return methods_for_engine("sglang", flag="--speculative-algorithm")


def validate_server_args(server_args) -> None:
    """Check a self-speculative launch against the served checkpoint; raise
    :class:`~diffspec.core.checkpoint.CheckpointError` (a ``ValueError``) naming the
    problem: a checkpoint of another family or without diffusion weights, more draft
    tokens than its block holds, a separate draft model, or a parallel layout the worker
    does not support (pipeline or data parallelism; tensor parallelism for TIDAR)."""
    name = str(server_args.speculative_algorithm).upper()
    method = self_spec_algorithms()[name]
    model = server_args.model_path
    info = inspect_checkpoint(model)
    require_method(info, method.name)
    if info.architecture not in method.architectures:
        raise CheckpointError(
            f"checkpoint {model} has architecture {info.architecture!r}; "
            f"--speculative-algorithm {name} is served by {', '.join(method.architectures)}")
    draft = server_args.speculative_draft_model_path
    if draft is not None and str(draft) != str(model):
        raise CheckpointError(
            f"--speculative-algorithm {name} drafts with the served model itself; it takes no "
            f"--speculative-draft-model-path (got {draft!r})")
    width = server_args.speculative_num_draft_tokens
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 2:
            raise CheckpointError(f"--speculative-num-draft-tokens must be an int >= 2 (the "
                                  f"anchor + at least one draft), got {width!r}")
        try:
            if method.name == "tidar":
                _validate_quadratic_drafts(info, width - 1)
            else:
                validate_block_size(info, width - 1)
        except CheckpointError as exc:
            raise CheckpointError(f"--speculative-num-draft-tokens {width} is the anchor plus "
                                  f"{width - 1} drafts: {exc}") from None
    # ORTHRUS / LINEAR_SELF_SPEC run their diffusion view on each tensor-parallel rank's
    # shards (diffspec.model_executors.sglang.views); TIDAR's quadratic view does not yet
    refused = [("--pp-size", server_args.pp_size), ("--dp-size", server_args.dp_size)]
    if method.name == "tidar":
        refused.insert(0, ("--tp-size", server_args.tp_size))
    for flag, value in refused:
        if value not in (None, 1):
            raise CheckpointError(f"--speculative-algorithm {name} supports {flag} 1 only "
                                  f"(got {value})")
    # PD disaggregation: a server's runtime switch to the decode role captures decode CUDA
    # graphs (disaggregation/role_switch.py, handle_pd_role_switch ->
    # ensure_decode_cuda_graphs) after handle_server_args turned them off (S2), and a
    # decode server takes its KV from a prefill server; neither is checked
    mode = str(getattr(server_args, "disaggregation_mode", None) or "null")
    if mode != "null":
        raise CheckpointError(
            f"remove --disaggregation-mode {mode} (serve prefill and decode in one server) "
            f"with --speculative-algorithm {name}: diffspec's speculative algorithms run "
            f"without CUDA graphs, which a switch to SGLang's decode role captures again, and "
            f"are not checked with a KV cache handed over from a prefill server")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
    if kv_dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"):
        raise CheckpointError(
            f"use --kv-cache-dtype auto with --speculative-algorithm {name}: its draft "
            f"attention reads the KV pool as plain values, without the scales a quantised "
            f"cache needs (got --kv-cache-dtype {kv_dtype})")
    _validate_diffspec_options(server_args, method.name)
    if getattr(server_args, "speculative_eagle_topk", None) not in (None, 1):
        raise CheckpointError(f"--speculative-algorithm {name} drafts one linear block; "
                              f"--speculative-eagle-topk must be 1")
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    error = attention_backend_error(name, attention_backends_of(server_args),
                                    getattr(server_args, "page_size", None))
    if error:
        raise CheckpointError(error)


def diffspec_options(server_args) -> dict[str, Any]:
    """The ``diffspec`` options of ``--json-model-override-args`` (``{}`` without any):
    what the workers read from the model config (``adaptive``, ``latency_profile``,
    ``prompt_lookup``)."""
    raw = getattr(server_args, "json_model_override_args", None) or "{}"
    try:
        overrides = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError as exc:
        raise CheckpointError(f"make --json-model-override-args a JSON object: {exc}") from None
    options = overrides.get("diffspec") if isinstance(overrides, dict) else None
    if options is not None and not isinstance(options, dict):
        raise CheckpointError(f"make \"diffspec\" in --json-model-override-args an object "
                              f"(keys: adaptive, latency_profile, prompt_lookup, carry), got "
                              f"{options!r}")
    return options or {}


DIFFSPEC_OPTIONS = ("adaptive", "latency_profile", "prompt_lookup", "carry")  # as vLLM's
_OVERRIDE = "--json-model-override-args '{\"diffspec\": {...}}'"


def _validate_diffspec_options(server_args, method: str) -> None:
    """Refuse the ``diffspec`` options the worker would refuse, with the server arguments
    (a clear error here rather than in the scheduler process), by vLLM's rules for the
    same keys (:func:`diffspec.plugin.vllm.config.diffspec_options`): ``adaptive`` true
    (the default) or false; ``latency_profile`` a readable profile, and only with
    adaptive drafting; ``prompt_lookup`` (:func:`~diffspec.core.lookup.
    prompt_lookup_settings`: on by default unless ``"adaptive": false``, never for TIDAR);
    ``carry`` (:func:`~diffspec.core.carry.carry_setting`)."""
    from pathlib import Path

    from diffspec.core.carry import carry_setting
    from diffspec.core.lookup import prompt_lookup_settings

    options = diffspec_options(server_args)
    unknown = sorted(set(options) - set(DIFFSPEC_OPTIONS))
    if unknown:
        raise CheckpointError(f"remove {', '.join(map(repr, unknown))} from {_OVERRIDE} "
                              f"(its keys: {', '.join(DIFFSPEC_OPTIONS)})")
    adaptive = options.get("adaptive")
    if adaptive not in (None, True, False):
        raise CheckpointError(f"set \"adaptive\" to true (the default: draft counts chosen "
                              f"per step) or false (--speculative-num-draft-tokens - 1 every "
                              f"step) in {_OVERRIDE}, got {adaptive!r}")
    try:
        prompt_lookup_settings(options.get("prompt_lookup"), method,
                               default=adaptive is not False)
    except ValueError as exc:
        raise CheckpointError(f"{exc} ({_OVERRIDE})") from None
    try:
        carry_setting(options.get("carry"), method, adaptive is not False)
    except ValueError as exc:
        raise CheckpointError(f"{exc} ({_OVERRIDE})") from None
    path = options.get("latency_profile")
    if path and adaptive is False:
        raise CheckpointError(f"remove \"latency_profile\" or the \"adaptive\": false from "
                              f"{_OVERRIDE}: a latency profile prices the adaptive policy's "
                              f"steps, and \"adaptive\": false drafts "
                              f"--speculative-num-draft-tokens - 1 every step")
    if path:
        from diffspec.core.adaptive import load_latency_profile

        try:
            load_latency_profile(json.loads(Path(path).expanduser().read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"point \"latency_profile\" at a forward-latency profile (python -m "
                f"benchmarks sweep --profile-only --engines sglang --model CKPT "
                f"--method {method} --out DIR writes one), or leave it out: the worker "
                f"measures one at start-up; {path!r} cannot be read as one: {exc}") from None


def attention_backend_error(algorithm: str, backends, page_size=None) -> str | None:
    """Why ``--speculative-algorithm algorithm`` cannot run on the resolved attention
    ``backends`` (``(prefill, decode)``, SGLang's ``attention_backends_of``), first words
    what to do; ``None`` when it can (:data:`VERIFY_BACKENDS`)."""
    todo = (f"use --attention-backend triton or flashinfer (torch_native on CPU) with "
            f"--speculative-algorithm {algorithm}")
    for backend in dict.fromkeys(b for b in backends if b is not None):
        if backend in VERIFY_BACKENDS:
            continue
        if backend == "fa3":
            why = ("fa3 plans every TARGET_VERIFY batch at the server's "
                   "--speculative-num-draft-tokens and ignores the batch's custom mask, while "
                   "diffspec's steps vary in width (adaptive draft counts, requests near their "
                   "end) and carry their own mask (the draft pass is non-causal, TIDAR's "
                   "branches are a tree): requests would be misaligned, wrong tokens at batch "
                   "> 1")
        else:
            why = (f"attention backend {backend} is not one whose verify path diffspec has "
                   f"checked (its steps need a TARGET_VERIFY that reads the step's own width "
                   f"and custom mask: {', '.join(VERIFY_BACKENDS)})")
        return f"{todo}: {why}"
    if (algorithm == "TIDAR" and page_size not in (None, 1)
            and set(b for b in backends if b is not None) != {"torch_native"}):
        return (f"set --page-size 1 with --speculative-algorithm TIDAR on a GPU attention "
                f"backend (got --page-size {page_size}): its branches are a tree of "
                f"overlapping positions, which SGLang's paged verify kernels handle only "
                f"with one token per page (as for NGRAM with topk > 1)")
    return None


def graphs_off_message(algorithm: str, phases) -> str:
    """The one log line :class:`TwoPassAlgo` writes when it turns CUDA graphs off."""
    return (f"diffspec: --speculative-algorithm {algorithm} runs without CUDA graphs; turning "
            f"them off ({' and '.join(phases)} phase), as --disable-cuda-graph does: SGLang "
            f"captures its verify graph with the inputs of its own algorithms only (EAGLE, "
            f"DFLASH, NGRAM) at a fixed width per request, while diffspec's steps vary in "
            f"width and run plain DECODE batches when nothing is drafted. Cost: kernel "
            f"launch overhead on every forward, most visible at small batches")


def graphs_disabled(graphs):
    """SGLang's ``CudaGraphConfig`` ``graphs`` with every phase off, and the phases that
    were on (``[]``: ``graphs`` itself)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    on = [p for p in Phase.ALL if getattr(graphs, p).backend != Backend.DISABLED]
    for phase in on:
        graphs = with_phase(graphs, phase, backend=Backend.DISABLED)
    return graphs, on


def quadratic_max_drafts(info) -> int:
    """Drafts per step a TiDAR / NLD checkpoint yields in quadratic mode: one branch of
    ``block_size`` masks, ``block_size - 1 + shift`` drafts (the reference decoder's
    :attr:`~diffspec.model_executors.reference.tidar.QuadraticModel.max_draft_tokens`)."""
    return int(info.block_size) - 1 + int(bool(info.logits_shift))


def _validate_quadratic_drafts(info, drafts: int) -> None:
    limit = quadratic_max_drafts(info)
    if not 1 <= drafts <= limit:
        raise CheckpointError(
            f"checkpoint {info.path} was trained with block_size={info.block_size} "
            f"({'shifted' if info.logits_shift else 'unshifted'} draft logits), so one "
            f"quadratic branch drafts at most {limit} tokens per step; {drafts} requested")


def activation_tokens(server_args) -> int:
    """The tokens one forward may run within SGLang's memory accounting: SGLang sizes the
    memory it leaves for activations (``mem_fraction_static``) per token of its largest
    planned forward, ``max(chunked_prefill_size, 2048)`` (``max_prefill_tokens`` without
    chunked prefill; disaggregated decode: running requests x draft tokens), as
    ``arg_groups/memory_hook.py`` computes ``activation_tokens`` (0.5.23: lines 297-313);
    its scheduler keeps every prefill batch within the chunk. Read from the resolved server
    arguments (the worker's)."""
    if getattr(server_args, "disaggregation_mode", None) == "decode":
        running = server_args.max_running_requests or 1
        return max(running * (server_args.speculative_num_draft_tokens or 1), 2048)
    chunk = server_args.chunked_prefill_size
    if chunk is not None and chunk > 0:
        return max(int(chunk), 2048)
    return max(int(server_args.max_prefill_tokens), 2048)


def tidar_kv_window(width: int, model_path, torch_native: bool) -> int:
    """KV slots a TIDAR decode step of ``width`` (anchor + drafts) writes per request past
    the committed length, in the window SGLang reserves there: on the torch-native
    backend only the ``width`` verify tokens (diffspec's masked attention reads the
    branches' K/V from the forward itself; their writes go to the pool's padding slot);
    on the GPU backends all ``(n + 1)(1 + K')`` tokens of the step (their TARGET_VERIFY
    kernels read the step's K/V from the pool through ``req_to_token``)."""
    from diffspec.model_executors.sglang.quadratic import tokens_per_step

    if torch_native:
        return int(width)
    return tokens_per_step(int(width) - 1, inspect_checkpoint(model_path).logits_shift)


_SPEC_CLASSES: dict[str, type] = {}


def spec_class(method: str = "orthrus"):
    """The ``CustomSpecAlgo`` subclass for ``method`` (built lazily, once: SGLang is
    imported only here): :class:`TwoPassAlgo` for the linear self-speculative methods,
    its ``TiDARAlgo`` subclass for ``tidar``."""
    if not _SPEC_CLASSES:
        _SPEC_CLASSES["linear"], _SPEC_CLASSES["tidar"] = _build_spec_classes()
    return _SPEC_CLASSES["tidar" if method == "tidar" else "linear"]


def _build_spec_classes():
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class TwoPassAlgo(CustomSpecAlgo):
        """What SGLang's scheduler asks of a self-speculative algorithm."""

        def has_draft_kv(self) -> bool:
            return False  # the diffusion view writes no K/V; verify writes W slots

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                             needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            """One linear block per step; synchronous scheduling; no mixed chunks; no CUDA
            graphs (:meth:`_graphs_off`)."""
            info = inspect_checkpoint(server_args.model_path)
            if server_args.speculative_num_draft_tokens is None:
                server_args.speculative_num_draft_tokens = int(info.block_size)
            server_args.speculative_num_steps = 1
            server_args.speculative_eagle_topk = 1
            if not server_args.disable_overlap_schedule:
                logger.warning(
                    "diffspec: --speculative-algorithm %s runs without overlap scheduling "
                    "(each step drafts from the tokens the previous step accepted); "
                    "turning it off, as --disable-overlap-schedule does", self.name)
                server_args.disable_overlap_schedule = True
            server_args.enable_mixed_chunk = False
            if server_args.max_running_requests is None:
                server_args.max_running_requests = 48
            self._graphs_off(server_args)

        def _graphs_off(self, server_args) -> None:
            """CUDA graphs off for every phase (SGLang's ``cuda_graph_config``, already
            parsed when this runs, and the legacy ``disable_cuda_graph``), with one log
            line when they were on."""
            from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

            graphs = getattr(server_args, "cuda_graph_config", None)
            if not isinstance(graphs, CudaGraphConfig):
                graphs = CudaGraphConfig.from_dict(graphs if isinstance(graphs, dict) else None)
                if getattr(server_args, "disable_cuda_graph", False):
                    graphs = graphs_disabled(graphs)[0]
            graphs, on = graphs_disabled(graphs)
            if on:
                logger.warning(graphs_off_message(self.name, on))
                server_args.cuda_graph_config = graphs
            server_args.disable_cuda_graph = True

        def create_worker(self, server_args):
            from sglang.srt.arg_groups.overrides import resolving_view

            if not resolving_view(server_args).disable_overlap_schedule:
                raise ValueError(f"--speculative-algorithm {self.name} does not support "
                                 f"overlap scheduling: pass --disable-overlap-schedule")
            return self.factory(server_args)

    class TiDARAlgo(TwoPassAlgo):
        """TIDAR: one quadratic forward per step, ``(n + 1)(1 + K')`` tokens per request
        (verify chain + one branch of ``K'`` masks per outcome)."""

        def handle_server_args(self, server_args) -> None:
            """As :class:`TwoPassAlgo`, but the default width is the anchor plus one
            trained branch of drafts (``block_size + shift``)."""
            if server_args.speculative_num_draft_tokens is None:
                server_args.speculative_num_draft_tokens = 1 + quadratic_max_drafts(
                    inspect_checkpoint(server_args.model_path))
            super().handle_server_args(server_args)

        def resolve_max_speculative_num_draft_tokens(self, server_args):
            """The step's KV window (:func:`tidar_kv_window`): SGLang reserves twice this
            many KV slots per request past its committed length
            (``eagle_prepare_for_decode``) and sizes its row headroom by it."""
            from sglang.srt.arg_groups.model_override_base import attention_backends_of
            from sglang.srt.arg_groups.overrides import resolving_view

            cfg = resolving_view(server_args)
            if cfg.speculative_num_draft_tokens is None:
                return None
            torch_native = set(attention_backends_of(cfg)) == {"torch_native"}
            return tidar_kv_window(cfg.speculative_num_draft_tokens, server_args.model_path,
                                   torch_native)

    return TwoPassAlgo, TiDARAlgo


def yaml_mapping(path: str | None, keys: tuple[str, ...]) -> dict[str, Any]:
    """The ``--dllm-algorithm-config`` file as a mapping (``{}`` without one); a
    :class:`CheckpointError` naming ``keys`` when it is not one."""
    if path is None:
        return {}
    import yaml

    with open(path) as f:
        options = yaml.safe_load(f) or {}
    if not isinstance(options, dict):
        raise CheckpointError(f"make {path} a YAML mapping (keys: {', '.join(keys)})")
    return options
