"""vLLM registration (entry point ``vllm.general_plugins: diffspec``).

vLLM loads general plugins in every process it starts (API server, engine core,
workers), so :func:`register` is idempotent. It refuses unsupported vLLM versions, then

* registers diffspec's model architectures as lazy ``"module:Class"`` strings
  (:data:`MODEL_ARCHITECTURES`) and the checkpoints' ``model_type`` names with transformers'
  ``AutoConfig`` (so ``"orthrus"`` / ``"nemotron_labs_diffusion"`` load without remote code);
* makes the two self-speculative methods (:data:`SELF_SPEC_METHODS`) selectable with vLLM's
  own flag, ``--speculative-config '{"method": "orthrus", "num_speculative_tokens": 31}'``,
  by applying the patches listed in ``diffspec/plugin/patches.md``
  (:mod:`diffspec.plugin.vllm_patches`).

How a method reaches vLLM: :func:`translate_speculative_config` validates the user's
speculative config against the checkpoint (one place, clear errors) and rewrites it to
vLLM's official extension point, ``{"method": "custom_class", "model": <proposer class>}``,
so every other part of vLLM (scheduler, rejection sampler, metrics, the choice of the V1
runner, async scheduling off) treats it as the custom proposer it is.

This module imports neither torch, transformers nor vLLM at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    require_method,
    validate_block_size,
)
from diffspec.plugin.versions import check_engine_version

logger = logging.getLogger("diffspec")

__all__ = [
    "MODEL_ARCHITECTURES",
    "SELF_SPEC_METHODS",
    "SelfSpecMethod",
    "is_self_spec_proposer",
    "register",
    "translate_speculative_config",
]

# Architecture name (config.json "architectures") -> "module:Class".
MODEL_ARCHITECTURES: dict[str, str] = {
    "OrthrusLM": "diffspec.model_executors.vllm_orthrus:OrthrusForCausalLM",
    "OrthrusForCausalLM": "diffspec.model_executors.vllm_orthrus:OrthrusForCausalLM",
    "OrthrusLlamaForCausalLM": "diffspec.model_executors.vllm_orthrus:OrthrusLlamaForCausalLM",
    "NemotronLabsDiffusionModel":
        "diffspec.model_executors.vllm_nld:NemotronLabsDiffusionForCausalLM",
}

# config.json "model_type" -> transformers config class ("module:Class"), for model types
# transformers does not know (the published repos ship them as remote code).
MODEL_TYPES: dict[str, str] = {
    "orthrus": "diffspec.plugin.hf_configs:OrthrusConfig",
    "nemotron_labs_diffusion": "diffspec.plugin.hf_configs:NemotronLabsDiffusionConfig",
}


@dataclass(frozen=True)
class SelfSpecMethod:
    """A self-speculative method as vLLM sees it: which checkpoints serve it (their
    architectures) and the proposer class handed to vLLM's ``custom_class`` hook."""

    name: str
    architectures: tuple[str, ...]
    proposer: str  # dotted path, the form vLLM's custom_class loader takes


SELF_SPEC_METHODS: dict[str, SelfSpecMethod] = {
    "orthrus": SelfSpecMethod(
        "orthrus",
        ("OrthrusLM", "OrthrusForCausalLM", "OrthrusLlamaForCausalLM"),
        "diffspec.spec_workers.vllm_self_spec.OrthrusProposer",
    ),
    "linear_self_spec": SelfSpecMethod(
        "linear_self_spec",
        ("NemotronLabsDiffusionModel",),
        "diffspec.spec_workers.vllm_self_spec.LinearSelfSpecProposer",
    ),
}

# speculative_config keys a self-speculative method honours -> accepted values (None: any).
_ALLOWED_OPTIONS: dict[str, tuple[Any, ...] | None] = {
    "method": None,
    "num_speculative_tokens": None,
    "model": None,  # only the served model itself (checked below)
    "enforce_eager": None,
    "draft_sample_method": ("greedy",),  # drafts are point masses (argmax of the diffusion view)
    "rejection_sample_method": ("standard",),
}

_registered = False


def is_self_spec_proposer(speculative_config: Any) -> bool:
    """True when a vLLM ``SpeculativeConfig`` is one :func:`translate_speculative_config` made."""
    return (
        speculative_config is not None
        and getattr(speculative_config, "method", None) == "custom_class"
        and getattr(speculative_config, "model", None)
        in {m.proposer for m in SELF_SPEC_METHODS.values()}
    )


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
    if name not in SELF_SPEC_METHODS:
        raise CheckpointError(
            f"unknown diffspec speculative method {name!r}; diffspec serves "
            f"{', '.join(sorted(SELF_SPEC_METHODS))}"
        )
    method = SELF_SPEC_METHODS[name]
    for key, value in spec.items():
        if key not in _ALLOWED_OPTIONS:
            raise CheckpointError(
                f"speculative_config option {key!r} does not apply to method {name!r} "
                f"(it drafts with the served model's own diffusion view); supported options: "
                f"{', '.join(_ALLOWED_OPTIONS)}"
            )
        allowed = _ALLOWED_OPTIONS[key]
        if allowed is not None and value is not None and value not in allowed:
            raise CheckpointError(
                f"method {name!r} cannot honour {key}={value!r}; supported: "
                f"{', '.join(map(repr, allowed))}"
            )
    draft_model = spec.get("model")
    if draft_model is not None and not _same_model(draft_model, checkpoint):
        raise CheckpointError(
            f"method {name!r} drafts with the served model itself ({checkpoint}); it takes no "
            f"separate draft model, got model={draft_model!r}"
        )

    info = _inspect(checkpoint, hf_config)
    if info is not None:
        require_method(info, name)
        architecture = info.architecture
        block_size = info.block_size
    else:  # weights not local yet: what config.json says (weights are checked at load)
        architecture = (list(hf_config.get("architectures") or []) or [None])[0]
        block_size = hf_config.get("block_size")
        for key in ("block_size", "mask_token_id"):
            if hf_config.get(key) is None:
                raise CheckpointError(f"checkpoint {checkpoint} has no {key} in config.json; "
                                      f"method {name!r} needs it")
    if architecture not in method.architectures:
        raise CheckpointError(
            f"checkpoint {checkpoint} has architecture {architecture!r}; method {name!r} is "
            f"served by the architectures {', '.join(method.architectures)}"
        )

    num = spec.get("num_speculative_tokens")
    if num is None:
        num = int(block_size) - 1
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise CheckpointError(f"num_speculative_tokens must be an int >= 1, got {num!r}")
    if info is not None:
        validate_block_size(info, num)
    elif num > int(block_size) - 1:
        raise CheckpointError(f"checkpoint {checkpoint} was trained with block_size={block_size}, "
                              f"so it drafts at most {int(block_size) - 1} tokens per step; "
                              f"{num} requested")

    out = {k: v for k, v in spec.items() if k not in ("method", "model")}
    out.update(method="custom_class", model=method.proposer, num_speculative_tokens=num)
    return out


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


def register() -> None:
    """Register diffspec with the running vLLM. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    import vllm

    check_engine_version("vllm", vllm.__version__)
    from vllm import ModelRegistry

    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.plugin.vllm_patches import apply_all

    register_model_types(MODEL_TYPES)
    for arch, target in MODEL_ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
    apply_all(vllm.__version__)
    _registered = True
    logger.info(
        "diffspec plugin loaded into vLLM %s (architectures: %s; speculative methods: %s)",
        vllm.__version__,
        ", ".join(MODEL_ARCHITECTURES),
        ", ".join(SELF_SPEC_METHODS),
    )
