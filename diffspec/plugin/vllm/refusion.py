"""ReFusion on vLLM's diffusion path: the config hook of a ReFusion checkpoint served with
``--diffusion-config`` and the per-request checks (patch ``refusion_requests``).

A ReFusion checkpoint is a stock ``Qwen3ForCausalLM`` (``mask_token_id`` in config.json).
Without ``--diffusion-config`` vLLM serves it as the causal Qwen3 it is; with it, this hook
(registered in vLLM's ``MODELS_CONFIG_MAP`` for ``Qwen3ForCausalLM``; a no-op for every
other Qwen3 and every run without ``--diffusion-config``) names diffspec's
``ReFusionForCausalLM`` (vLLM's Qwen3 plus the model state
:class:`diffspec.spec_workers.vllm.refusion.ReFusionModelState`) and resolves the settings.

Settings: ``--diffusion-config '{"canvas_length": N}'``: the most tokens a request may
generate (the KV block it gets, SGLang's ``block_size``; default 256, a multiple of
``slot_size``); ``--additional-config '{"diffspec": {"refusion": {...}}}'``: ``slot_size``,
``slot_threshold``, ``token_threshold``, ``num_blocks`` (registry defaults).

This module imports neither torch nor vLLM at import time.

Design notes: docs/design/plugins.md (section ``diffspec/plugin/vllm/refusion.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
from diffspec.methods import get_method
from diffspec.plugin.vllm.dllm import (
    DIFFUSION_BACKENDS,
    METHOD_ATTRIBUTE,
    DiffusionConfigError,
    method_options,
    name_gpu_backend,
    neutral_sampling_defaults,
    no_async_scheduling,
    refuse_attention_backends,
    register_hook,
    require_v2_runner,
)

logger = logging.getLogger("vllm.diffspec")

__all__ = ["ARCHITECTURE", "ATTRIBUTE", "DEFAULT_CANVAS", "ReFusionConfigError",
           "refusion_backend_error", "refusion_request_error", "register_refusion_hook",
           "verify_and_update_config"]

ARCHITECTURE = "ReFusionForCausalLM"  # the class the hook names (registry family refusion)
ATTRIBUTE = "diffspec_refusion"  # hf_config attribute: the resolved settings (both processes)
DEFAULT_CANVAS = 256  # as SGLang's default block_size
_KNOBS = ("slot_size", "slot_threshold", "token_threshold", "num_blocks")
_FLAG = "--additional-config '{\"diffspec\": {\"refusion\": {...}}}'"


class ReFusionConfigError(DiffusionConfigError):
    """vLLM cannot serve this ReFusion configuration (the message starts with what to do)."""


def refusion_backend_error(named: str | None) -> str | None:
    """Why ReFusion cannot run on the attention backend the user named, or ``None``: every
    forward of ReFusion is causal, checked over an eager forward's own metadata on CPU_ATTN
    and on TRITON_ATTN, the one vLLM's diffusion path runs on a GPU."""
    if named is None or named.upper() in ("AUTO", *DIFFUSION_BACKENDS):
        return None
    return (f"use --attention-backend TRITON_ATTN (GPU) or CPU_ATTN (CPU) to serve ReFusion: "
            f"its model state runs several forwards per step, each with attention metadata it "
            f"builds for that forward (and one attention call per parallel-completion row), "
            f"which diffspec checks on those backends only; {named.upper()} is not checked")


def refusion_settings(additional_config: Any, canvas: int | None) -> dict[str, Any]:
    """The resolved settings (registry defaults filled in, checked); a
    :class:`CheckpointError` whose first words say what to do otherwise."""
    from diffspec.core.slots import width_error
    from diffspec.spec_workers.reference.refusion import ReFusionConfig

    options = method_options(additional_config, "refusion", _FLAG, "ReFusion", _KNOBS,
                             {"canvas_length", "mask_token_id"},
                             "the most tokens a request may generate is --diffusion-config's "
                             "canvas_length")
    defaults = get_method("refusion").defaults
    try:
        config = ReFusionConfig(**{k: options.get(k, defaults[k]) for k in _KNOBS})
    except ValueError as exc:
        raise CheckpointError(f"fix diffspec.refusion in {_FLAG}: {exc}") from None
    canvas = DEFAULT_CANVAS if canvas is None else canvas
    why = width_error(canvas, config.slot_size, config.num_blocks,
                      "--diffusion-config's canvas_length")
    if why:
        raise CheckpointError(why)
    return {"slot_size": config.slot_size, "slot_threshold": float(config.slot_threshold),
            "token_threshold": float(config.token_threshold), "num_blocks": config.num_blocks,
            "canvas_length": canvas}


def refusion_request_error(prompt_len: int, max_tokens: int, settings: dict[str, Any],
                           max_model_len: int, canvas: int | None = None) -> str | None:
    """Why ReFusion cannot decode a request (first words: what to do), or ``None``.
    ``canvas``: the request's own width (``extra_args["diffusion_canvas_length"]``)."""
    from diffspec.core.slots import slot_layout

    slot, blocks = settings["slot_size"], settings["num_blocks"]
    width = canvas or settings["canvas_length"]
    gen_len, block_len = slot_layout(max_tokens, slot, blocks)
    if gen_len > width:
        return (f"set max_tokens <= {width // slot * slot} or raise --diffusion-config's "
                f"canvas_length (or the request's diffusion_canvas_length): ReFusion decodes a "
                f"request's whole generation in the canvas vLLM schedules for it; max_tokens "
                f"{max_tokens} rounds up to {gen_len} (whole slots of {slot})")
    if block_len is None:
        return (f"set max_tokens to a multiple of {slot * blocks} (or change num_blocks / "
                f"slot_size): {gen_len} tokens ({max_tokens} rounded up to whole slots of "
                f"{slot}) do not split into {blocks} serial blocks of whole slots")
    if prompt_len + gen_len > max_model_len:
        return (f"shorten the prompt or lower max_tokens (or raise --max-model-len): the "
                f"prompt ({prompt_len} tokens) and {gen_len} generated positions (max_tokens "
                f"rounded up to whole slots) exceed max_model_len {max_model_len}")
    return None


def verify_and_update_config(vllm_config: Any) -> None:
    """The hook (module docstring): acts only for a ReFusion checkpoint with
    ``--diffusion-config``."""
    model_config = vllm_config.model_config
    requested = vllm_config.diffusion_config
    if requested is None:
        return  # a causal Qwen3 run (ReFusion's checkpoint too): vLLM's own
    info = inspect_checkpoint(model_config.model)
    if info.family != "refusion":
        return  # not ours (a TiDAR or plain Qwen3 checkpoint)
    if vllm_config.speculative_config is not None:
        raise CheckpointError("remove --speculative-config or --diffusion-config: ReFusion "
                              "(vLLM's diffusion path) does not combine with speculative "
                              "decoding")
    if requested.max_denoising_steps is not None:
        raise CheckpointError("remove max_denoising_steps from --diffusion-config: ReFusion "
                              "decodes a request's whole generation in one step")
    settings = refusion_settings(vllm_config.additional_config, requested.canvas_length)
    canvas = settings["canvas_length"]
    budget = vllm_config.scheduler_config.max_num_batched_tokens
    if budget is not None and budget < canvas:
        raise CheckpointError(f"raise --max-num-batched-tokens to at least {canvas} (got "
                              f"{budget}) or lower canvas_length: a ReFusion request's canvas "
                              f"is scheduled whole or not at all")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise CheckpointError(
            "serve ReFusion with --tensor-parallel-size 1 and --pipeline-parallel-size 1 (or "
            "on SGLang's dLLM mode): its sampler runs forwards of its own after vLLM's, which "
            "diffspec has checked on one device only")
    attention = getattr(vllm_config, "attention_config", None)
    refuse_attention_backends(attention, refusion_backend_error)
    no_async_scheduling(vllm_config, "ReFusion")
    require_v2_runner("ReFusion", "ReFusion")
    name_gpu_backend(attention, "ReFusion")

    from vllm.config.diffusion import DiffusionConfig

    from diffspec.core.slots import longest_layout

    vllm_config.diffusion_config = DiffusionConfig(canvas_length=canvas)
    hf_config = model_config.hf_config
    hf_config.canvas_length = canvas
    hf_config.architectures = [ARCHITECTURE]  # the worker loads diffspec's class
    model_config.__dict__.pop("is_diffusion", None)  # a cached_property read before the hook
    setattr(hf_config, METHOD_ATTRIBUTE, "ReFusion")
    neutral_sampling_defaults(model_config, "ReFusion")
    # a chat request with no max_tokens gets the canvas's longest layout (vLLM: what is left of
    # max_model_len, which no canvas holds): the server's default, a user's own kept
    model_config.override_generation_config.setdefault(
        "max_new_tokens", longest_layout(canvas, settings["slot_size"], settings["num_blocks"]))
    settings["mask_token_id"] = int(info.mask_token_id)
    setattr(hf_config, ATTRIBUTE, settings)
    # the checkpoint's EOS ids are vLLM's stops (patch generation_stops), as the reference's
    hf_config.diffspec_stop_token_ids = list(info.eos_token_ids)
    if not isinstance(vllm_config.additional_config, dict):
        vllm_config.additional_config = {}
    vllm_config.additional_config.setdefault("diffspec", {})["refusion"] = dict(settings)
    logger.info("diffspec: ReFusion on vLLM's diffusion path: canvas %d, slots of %d, %d "
                "serial block(s), thresholds %s / %s; a request's default max_tokens %s",
                canvas, settings["slot_size"], settings["num_blocks"],
                settings["slot_threshold"], settings["token_threshold"],
                model_config.override_generation_config["max_new_tokens"])


def register_refusion_hook() -> None:
    """The hook for ``Qwen3ForCausalLM`` (:func:`~diffspec.plugin.vllm.dllm.register_hook`;
    an entry vLLM has for it wins)."""
    register_hook(get_method("refusion").architectures, verify_and_update_config,
                  ReFusionConfigError)
