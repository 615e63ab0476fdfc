"""vLLM config translation: a diffspec method's ``speculative_config`` checked against the
served checkpoint (one place, clear errors) and rewritten to vLLM's official extension
point, ``{"method": "custom_class", "model": <proposer class>}``, so every other part of
vLLM (scheduler, rejection sampler, metrics, the choice of the V1 runner, async scheduling
off) treats it as the custom proposer it is. Which methods exist, which architectures serve
them and their proposer classes come from the registry (:mod:`diffspec.methods`).

This module imports neither torch, transformers nor vLLM.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    max_block_tokens,
    require_method,
    validate_block_size,
)
from diffspec.methods import Method, methods_for_engine

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level

__all__ = ["GPU_ATTENTION_BACKEND", "attention_backend_error", "budget_error", "cudagraph_plan",
           "gpu_default_backend",
           "named_backends", "split_kernel_block_message", "tidar_kernel_split_error",
           "diffspec_options", "drafting_rows", "is_self_spec_proposer", "proposer_path",
           "self_spec_methods", "tidar_branch_rows", "translate_speculative_config",
           "unknown_method_message"]

SPEC_FLAG = "--speculative-config"


def self_spec_methods() -> dict[str, Method]:
    """diffspec's methods served through vLLM's ``speculative_config``, by method name
    (not ``fast_dllm``, which runs on vLLM's diffusion path: ``--diffusion-config``)."""
    return methods_for_engine("vllm", flag=SPEC_FLAG)


def proposer_path(method: str) -> str:
    """The dotted path of a method's proposer, the form vLLM's ``custom_class`` loader takes."""
    entry = self_spec_methods()[method].vllm
    assert entry is not None and entry.worker is not None
    return entry.worker.replace(":", ".")


# speculative_config keys a self-speculative method honours -> accepted values (None: any).
_ALLOWED_OPTIONS: dict[str, tuple[Any, ...] | None] = {
    "method": None,
    "num_speculative_tokens": None,
    "model": None,  # only the served model itself (checked below)
    "enforce_eager": None,
    "draft_sample_method": ("greedy",),  # drafts are point masses (argmax of the diffusion view)
    "rejection_sample_method": ("standard",),
    # diffspec's own (not vLLM's): handed to the proposer through additional_config
    "adaptive": (True, False),  # draft counts chosen per step from the load (default true)
    "latency_profile": None,  # JSON latency profile instead of the one measured at start-up
    # prompt-lookup drafts where the context holds an n-gram match: false, true or
    # {"min": 2, "max": 4} (default on unless "adaptive": false; never for tidar)
    "prompt_lookup": None,
    # over-draft and carry a fully accepted block's rest to the next step (two-pass methods):
    # "auto" (default: where the latency profile says it pays), "always", "off" (or false)
    "carry": None,  # checked by diffspec_options
}
DIFFSPEC_OPTIONS = ("adaptive", "latency_profile", "prompt_lookup", "carry")

def is_self_spec_proposer(speculative_config: Any) -> bool:
    """True when a vLLM ``SpeculativeConfig`` is one :func:`translate_speculative_config` made."""
    return (
        speculative_config is not None
        and getattr(speculative_config, "method", None) == "custom_class"
        and getattr(speculative_config, "model", None)
        in {proposer_path(name) for name in self_spec_methods()}
    )


def tidar_branch_rows(num_drafts: int, logits_shift: bool) -> int:
    """The most branch rows one request adds to a ``tidar`` step's forward besides its
    scheduled tokens: ``n + 1 <= K + 1`` branches of ``K + skip`` masks (``K`` =
    ``num_speculative_tokens``; ``skip`` 1 for unshifted draft logits), the bound of
    :func:`diffspec.spec_workers.vllm.tidar.plan_branches`."""
    return (num_drafts + 1) * (num_drafts + (0 if logits_shift else 1))


def drafting_rows(speculative_config: Any) -> int | None:
    """Rows diffspec's method appends to the target forward per scheduled request, which
    vLLM's scheduler reserves in each step's token budget (its
    ``SpeculativeConfig.max_num_new_slots_for_drafting``; patch ``drafting_rows``): the
    ``tidar`` branches (:func:`tidar_branch_rows`); ``None`` for every other config (vLLM's
    own answer)."""
    if not is_self_spec_proposer(speculative_config) \
            or speculative_config.model != proposer_path("tidar"):
        return None
    hf_config = getattr(speculative_config.target_model_config, "hf_config", None)
    return tidar_branch_rows(int(speculative_config.num_speculative_tokens),
                             getattr(hf_config, "dlm_type", None) == "dream")


def budget_error(max_num_batched_tokens: int | None, num_drafts: int,
                 logits_shift: bool) -> str | None:
    """The refusal of a ``tidar`` token budget that cannot hold one request's full step
    (its ``K + 1`` scheduled tokens and its branch rows), else ``None``."""
    rows = tidar_branch_rows(num_drafts, logits_shift)
    need = num_drafts + 1 + rows
    if max_num_batched_tokens is None or max_num_batched_tokens >= need:
        return None
    return (f"raise max_num_batched_tokens (--max-num-batched-tokens) to at least {need} (got "
            f"{max_num_batched_tokens}) or lower num_speculative_tokens: a 'tidar' step "
            f"forwards up to {rows} branch rows per request besides its {num_drafts + 1} "
            f"scheduled tokens, and vLLM's scheduler reserves them in the step's token budget, "
            f"the rows its memory profile forwarded (docs/gpu-support.md, memory)")


def translate_speculative_config(
    spec: Mapping[str, Any],
    checkpoint: str | Path,
    hf_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate a self-speculative ``speculative_config`` against the served checkpoint and
    return the equivalent config for vLLM's ``custom_class`` hook.

    ``checkpoint`` is the served model (a folder, or a hub id found in the local cache);
    ``hf_config`` is its config.json as vLLM read it, used when the weights are not local
    yet (then the diffusion weights are checked when vLLM loads them). Raises
    :class:`~diffspec.core.checkpoint.CheckpointError` (a ``ValueError``) naming the
    problem: an unknown method, an option the method cannot honour, a checkpoint without
    diffusion weights, or more drafts than the checkpoint's block holds.
    """
    name = spec.get("method")
    methods = self_spec_methods()
    if name not in methods:
        raise CheckpointError(unknown_method_message(name, diffspec_only=True))
    method = methods[name]
    for key, value in spec.items():
        if key not in _ALLOWED_OPTIONS:
            raise CheckpointError(
                f"remove {key!r} from the speculative_config (supported options: "
                f"{', '.join(_ALLOWED_OPTIONS)}): speculative_config option {key!r} does not "
                f"apply to method {name!r} (it drafts with the served model's own diffusion "
                f"view)"
            )
        allowed = _ALLOWED_OPTIONS[key]
        if allowed is not None and value is not None and value not in allowed:
            raise CheckpointError(
                f"set {key} to {' or '.join(map(repr, allowed))}, or leave it out: method "
                f"{name!r} cannot honour {key}={value!r}"
            )
    draft_model = spec.get("model")
    if draft_model is not None and not _same_model(draft_model, checkpoint):
        raise CheckpointError(
            f"remove \"model\" from the speculative_config: method {name!r} drafts with the "
            f"served model itself ({checkpoint}); it takes no separate draft model, got "
            f"model={draft_model!r}"
        )

    info = _inspect(checkpoint, hf_config)
    if info is not None:
        try:
            require_method(info, name)
        except CheckpointError as exc:
            raise CheckpointError(f"{_wrong_checkpoint_advice(name, info.family)}: {exc}") \
                from None
        architecture = info.architecture
        block_size = info.block_size
    else:  # weights not local yet: what config.json says (weights are checked at load)
        architecture = (list(hf_config.get("architectures") or []) or [None])[0]
        block_size = hf_config.get("block_size")
        for key in ("block_size", "mask_token_id"):
            if hf_config.get(key) is None:
                raise CheckpointError(f"{_wrong_checkpoint_advice(name, None)}: checkpoint "
                                      f"{checkpoint} has no {key} in config.json; method "
                                      f"{name!r} needs it")
    if architecture not in method.architectures:
        raise CheckpointError(
            f"serve a checkpoint whose config.json names one of the architectures "
            f"{', '.join(method.architectures)} with method {name!r}: checkpoint {checkpoint} "
            f"has architecture {architecture!r}"
        )

    limit = max_block_tokens(info) if info is not None else int(block_size) - 1
    num = spec.get("num_speculative_tokens")
    if num is None:  # the checkpoint's trained block
        num = limit
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise CheckpointError(f"set num_speculative_tokens to an int >= 1"
                              f"{f' and <= {limit}' if limit else ''} (or leave it out: the "
                              f"checkpoint's whole block): num_speculative_tokens must be an "
                              f"int >= 1, got {num!r}")
    advice = (f"set num_speculative_tokens to at most {limit} (or leave it out: the "
              f"checkpoint's whole block)")
    if info is not None:
        try:
            validate_block_size(info, num)
        except CheckpointError as exc:
            raise CheckpointError(f"{advice}: {exc}") from None
    elif num > limit:
        raise CheckpointError(f"{advice}: checkpoint {checkpoint} was trained with "
                              f"block_size={block_size}, so it drafts at most {limit} tokens "
                              f"per step; {num} requested")

    diffspec_options(spec)  # validated here; the patch moves them to additional_config
    out = {k: v for k, v in spec.items() if k not in ("method", "model", *DIFFSPEC_OPTIONS)}
    out.update(method="custom_class", model=proposer_path(name), num_speculative_tokens=num)
    return out


# The attention backends the self-speculative methods run on: CPU_ATTN (verified on CPU by
# the engine tier), TRITON_ATTN (its own Triton kernels and metadata builder run by the
# engine tier in Triton's interpreter on CPU: tests/engine/test_vllm_triton_attn.py) and
# FLASH_ATTN (reasoned from vLLM's code, CUDA code never run here: its metadata builder
# makes fresh metadata per build and accepts causal=False over the paged cache;
# docs/gpu-support.md). On a GPU the plugin names TRITON_ATTN, the one whose kernels have
# run, when the user names none: vLLM's own choice would be FLASH_ATTN, else FlashInfer.
GPU_ATTENTION_BACKEND = "TRITON_ATTN"
CHECKED_ATTENTION_BACKENDS = ("CPU_ATTN", GPU_ATTENTION_BACKEND, "FLASH_ATTN")


def gpu_default_backend(named: list[tuple[str, str]], on_gpu: bool) -> str | None:
    """The attention backend the plugin names for a self-speculative launch: on a GPU
    (``on_gpu``) where the user named no global backend (``named``: :func:`named_backends`),
    :data:`GPU_ATTENTION_BACKEND`, the GPU backend whose own kernels ran the methods here;
    else ``None`` (the user's choice, or vLLM's CPU_ATTN on a CPU)."""
    if not on_gpu or any(where == "--attention-backend" for where, _ in named):
        return None
    return GPU_ATTENTION_BACKEND


def named_backends(attention_config: Any, global_name: Any = None) -> list[tuple[str, str]]:
    """Every attention backend the user named, as ``(where, NAME)``: the global one
    (``global_name``, else ``attention_config.backend``) and each entry of
    ``attention_config.backend_per_kind``, which vLLM's selector gives the layers of that
    KV-cache kind instead of the global backend (``get_attn_backend`` in
    ``vllm/v1/attention/selector.py``, vLLM 0.32 and 0.33). A check of the backend a
    method runs on must read them all; "auto" and unset names are left out."""
    if isinstance(attention_config, Mapping):
        named, per_kind = attention_config.get("backend"), attention_config.get("backend_per_kind")
    else:
        named = getattr(attention_config, "backend", None)
        per_kind = getattr(attention_config, "backend_per_kind", None)
    out = []
    for where, backend in [("--attention-backend", global_name or named),
                           *((f"backend_per_kind[{kind!r}] of --attention-config", backend)
                             for kind, backend in (per_kind or {}).items())]:
        name = getattr(backend, "name", backend)
        if name is not None and str(name).upper() != "AUTO":
            out.append((where, str(name).upper()))
    return out


def per_kind_note(where: str) -> str:
    """What a refusal of a per-kind backend adds after its reason (empty for the global)."""
    if where == "--attention-backend":
        return ""
    return (f" (named in {where}, which vLLM uses instead of --attention-backend for the "
            f"layers of that kind: remove the entry or name a backend above)")


def split_kernel_block_message(block_size: int, kernel: int, backend: str) -> str:
    """The refusal of TiDAR on vLLM's V2 runner over KV blocks split into kernel blocks."""
    return (f"set --block-size {kernel} (a block size the attention backend {backend} runs "
            f"as it is) for method 'tidar' on vLLM's V2 model runner: its KV blocks of "
            f"{block_size} tokens are split into kernel blocks, whose block tables vLLM maps "
            f"into one buffer per attention group, and the branches' metadata, built before "
            f"the verify runs, would overwrite the verify's")


def tidar_kernel_split_error(vllm_config: Any, backend_class: Any = None) -> str | None:
    """At config time, before the weights load: why TiDAR cannot run on vLLM's V2 runner
    with this configuration's KV blocks (:func:`split_kernel_block_message`), or ``None``.

    The runner splits a KV block into kernel blocks when its attention backend does not run
    the block size as it is (``AttentionGroup.create_metadata_builders`` ->
    ``select_common_block_size``, ``vllm/v1/worker/utils.py``). The block size is the
    user's ``--block-size``, else the one vLLM picks after the model loads for its one
    backend (``update_block_size_for_backend`` -> ``get_preferred_block_size``); both are
    computed here with vLLM's own functions, for the backend the launch names for full
    attention (``backend_per_kind['full_attention']``, else the global one; diffspec names
    TRITON_ATTN on a GPU when the user names none). ``backend_class``: that backend's class
    (default: looked up). With no backend named (vLLM's automatic choice, CPU_ATTN on a
    CPU) the runner's own check refuses it when it sets up the KV cache."""
    from vllm.config.cache import CacheConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.v1.worker.utils import select_common_block_size

    if backend_class is None:
        named = dict(named_backends(vllm_config.attention_config))
        name = named.get("backend_per_kind['full_attention'] of --attention-config",
                         named.get("--attention-backend"))
        if name is None:
            return None
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        try:
            backend_class = AttentionBackendEnum[name].get_class()
        except (ImportError, KeyError):  # not on this platform: vLLM's own error follows
            return None
    cache = vllm_config.cache_config
    with set_current_vllm_config(vllm_config):
        block = cache.block_size if getattr(cache, "user_specified_block_size", True) \
            else backend_class.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
        try:
            kernel = select_common_block_size(block, [backend_class])
        except ValueError:  # no kernel block at all: vLLM's own error at KV cache setup
            return None
    if kernel == block:
        return None
    return split_kernel_block_message(block, kernel, backend_class.get_name())


def attention_backend_error(method: str, named: str | None) -> str | None:
    """Why method ``method`` cannot run on the attention backend the user named (first
    words: what to do), or ``None``."""
    if named is None or named.upper() in ("AUTO", *CHECKED_ATTENTION_BACKENDS):
        return None
    named = named.upper()
    if named == "FLASHINFER" and method == "tidar":
        why = ("TiDAR builds the metadata of a step's n + 1 branches on the target's "
               "FlashInfer builder before any branch runs, and FlashInfer's builds share one "
               "re-planned wrapper and a persistent page-index buffer, so the verify and the "
               "earlier branches would run with the last branch's plan (wrong drafts or wrong "
               "verify reads)")
    elif named == "FLASHINFER":
        why = ("its draft pass attends non-causally over the paged KV cache, and vLLM itself "
               "keeps FlashInfer's non-causal path out of its default order on SM100 (known "
               "problems, platforms/cuda.py); not checked by diffspec")
    else:
        why = (f"its draft pass attends non-causally over the paged KV cache, which diffspec "
               f"has checked on {', '.join(CHECKED_ATTENTION_BACKENDS)} only, not on "
               f"{named}")
    return (f"use --attention-backend {GPU_ATTENTION_BACKEND} or FLASH_ATTN (GPU) or "
            f"CPU_ATTN (CPU) with method {method!r}: {why}")


def cudagraph_plan(method: str, adaptive: bool, mode: str | None, enforce_eager: bool,
                   on_gpu: bool, v2_runner: bool = False) -> str | None:
    """The ``cudagraph_mode`` a self-speculative launch must run with: ``"PIECEWISE"``
    or, for ``tidar`` on the V2 runner, ``"NONE"`` (to set: the user set none) or ``None``
    (leave it). Raises :class:`CheckpointError`
    for a mode with full CUDA
    graphs where the method cannot run under them: ``tidar`` (its branch metadata, built
    before the branches run, would share FLASH_ATTN's persistent FA3 scheduler metadata,
    which full graphs keep in one buffer; TRITON_ATTN's metadata point at the runner's
    persistent input buffers, which a captured verify replays: whatever the backend, graphs
    are not run here), any method with ``"adaptive": true`` or prompt
    lookup (``adaptive`` here: either; the verify length changes per step: vLLM's own rule
    for dynamic speculative decoding on the V1 runner is PIECEWISE, config/vllm.py
    ``_maybe_override_dynamic_sd_cudagraph_mode``) and any method on vLLM's V2 model runner
    (``v2_runner``: its draft pass builds attention metadata on the target's builders
    between the verify graphs' replays, not run on a GPU yet)."""
    if enforce_eager or not (method == "tidar" or adaptive or v2_runner):
        return None
    if method == "tidar" and v2_runner:
        if mode is None:
            return "NONE" if on_gpu else None
        if mode.upper() == "NONE":
            return None
        raise CheckpointError(
            f"set compilation_config's cudagraph_mode to NONE (or add --enforce-eager, or "
            f"leave cudagraph_mode out) for method 'tidar' on vLLM's V2 model runner, or "
            f"unset VLLM_USE_V2_MODEL_RUNNER (the V1 runner runs it with PIECEWISE graphs): "
            f"cudagraph_mode {mode} replays captured graphs (the V2 runner's FULL graphs, "
            f"or its breakable PIECEWISE ones) without the model's Python forward, where "
            f"TiDAR's branches join the verify forward")
    if mode is None:
        return "PIECEWISE" if on_gpu else None
    if mode.upper() in ("NONE", "PIECEWISE"):
        return None
    why = ("its branches' attention metadata are built before they run and would share the "
           "FA3 scheduler metadata that full CUDA graphs keep in one persistent buffer"
           if method == "tidar" else
           "on vLLM's V2 model runner its draft pass builds attention metadata on the "
           "target's builders, whose persistent buffers full graphs replay (not checked on "
           "a GPU)" if v2_runner else
           "\"adaptive\": true changes the verify length from step to step (vLLM runs "
           "dynamic speculative decoding on the V1 runner with PIECEWISE graphs too)")
    raise CheckpointError(
        f"set compilation_config's cudagraph_mode to PIECEWISE or NONE (or add "
        f"--enforce-eager, or leave cudagraph_mode out) for method {method!r}: "
        f"cudagraph_mode {mode} captures full CUDA graphs, and {why}")


def unknown_method_message(method: Any, vllm_methods: Iterable[str] = (),
                           diffspec_only: bool = False) -> str:
    """The error for a ``speculative_config`` method nobody serves; its first words say
    what to use instead (the closest name first, when one is close)."""
    ours = sorted(self_spec_methods())
    theirs = sorted(vllm_methods)
    close = difflib.get_close_matches(str(method), ours + theirs, n=1, cutoff=0.6)
    head = f"use \"method\": \"{close[0]}\" or another of: " if close else "use one of: "
    names = ", ".join(ours) + (f" (diffspec), {', '.join(theirs)} (vLLM)" if theirs else "")
    what = "diffspec speculative method" if diffspec_only else "speculative method"
    return f"{head}{names} (unknown {what} {method!r})"


def _wrong_checkpoint_advice(method: str, family: str | None) -> str:
    """What to do when the served checkpoint cannot serve ``method``: a checkpoint of the
    method's family, or the method that serves this checkpoint's family."""
    methods = self_spec_methods()
    wanted = " or ".join(methods[method].families)
    advice = f"serve a checkpoint of family {wanted} with method {method!r}"
    others = [n for n, m in methods.items() if n != method and family in m.families]
    if others:
        advice += (f", or use method {' or '.join(map(repr, others))}, which serve"
                   f"{'s' if len(others) == 1 else ''} this {family} checkpoint")
    return advice


def _same_model(a: str | Path, b: str | Path) -> bool:
    """Whether two model names / paths name the same checkpoint."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return str(a) == str(b)


def _inspect(checkpoint: str | Path, hf_config: Mapping[str, Any] | None):
    """The checkpoint's :class:`CheckpointInfo`, or ``None`` for a hub id whose files are
    not in the local cache yet (only when its ``hf_config`` is known)."""
    try:
        return inspect_checkpoint(checkpoint)
    except CheckpointError:
        if hf_config is None or Path(checkpoint).expanduser().exists():
            raise
        logger.info("diffspec: %s is not local yet; checking its config.json only", checkpoint)
        return None


def diffspec_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The diffspec-only keys of a ``speculative_config``, checked and completed:
    ``adaptive`` (default true: draft counts chosen per step, ``num_speculative_tokens``
    the most; false: that many every step), optionally ``latency_profile`` (a JSON
    profile that replaces the one the engine measures at start-up), and
    ``prompt_lookup`` (``{"min": 2, "max": 4}`` or ``None``: off; on unless the config
    says ``"adaptive": false``, the heads alone at a fixed count, or ``"prompt_lookup":
    false``; never for tidar: :func:`~diffspec.core.lookup.prompt_lookup_settings`), and
    ``carry`` (``"auto"``, ``"always"`` or ``"off"``: over-drafting for carried drafts,
    :meth:`~diffspec.core.adaptive.AdaptiveDrafts.draft_widths`; two-pass methods with
    adaptive drafts only). The
    proposer reads them from ``vllm_config.additional_config["diffspec"]``."""
    from diffspec.core.carry import carry_setting
    from diffspec.core.lookup import prompt_lookup_settings

    options = {"adaptive": spec.get("adaptive", True)}
    if options["adaptive"] is None:
        options["adaptive"] = True
    try:
        lookup = prompt_lookup_settings(spec.get("prompt_lookup"), str(spec.get("method")),
                                        default=spec.get("adaptive") is not False)
    except ValueError as exc:
        raise CheckpointError(f"{exc} (speculative_config)") from None
    options["prompt_lookup"] = None if lookup is None else lookup.as_dict()
    try:
        options["carry"] = carry_setting(spec.get("carry"), str(spec.get("method")),
                                         bool(options["adaptive"]))
    except ValueError as exc:
        raise CheckpointError(f"{exc} (speculative_config)") from None
    path = spec.get("latency_profile")
    if path and not options["adaptive"]:
        raise CheckpointError(
            "remove \"latency_profile\" or the \"adaptive\": false from the speculative_config: "
            "a latency profile prices the adaptive policy's steps, and \"adaptive\": false "
            "drafts num_speculative_tokens every step")
    if path:
        measure = (f"python -m benchmarks sweep --profile-only --engines vllm "
                   f"--method {spec.get('method', 'orthrus')} --model CKPT --out DIR, through "
                   f"this engine: DIR/vllm-latency-profile.json; or leave it out: the engine "
                   f"measures one at start-up")
        try:
            from diffspec.core.adaptive import load_latency_profile

            options["latency_profile"] = str(Path(path).expanduser().resolve())
            load_latency_profile(json.loads(Path(options["latency_profile"]).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"point \"latency_profile\" at a forward-latency profile "
                                  f"(write one with {measure}): {path!r} cannot be read as "
                                  f"one: {exc}") from None
    return options
