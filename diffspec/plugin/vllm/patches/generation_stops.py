"""Patch: ``vllm.config.model.ModelConfig.try_get_generation_config``.

Why: Fast-dLLM on vLLM's diffusion path must stop where the reference decoder and the SGLang
path stop: the checkpoint's EOS ids and its chat template's turn end, which for instruct
diffusion LMs is not the EOS vLLM reads (LLaDA-8B-Instruct ends a turn with ``<|eot_id|>``
126348, its EOS is 126081; Dream's turn end ``<|im_end|>`` 151645, EOS 151643). vLLM's stop
check (``check_stop``: the request's EOS and ``stop_token_ids``) is the only one that ends a
request, and the model state cannot end one itself; a request's ``stop_token_ids`` get the
generation config's extra EOS ids (``SamplingParams.update_from_generation_config``, unless
``ignore_eos``), which is how vLLM stops a Llama-3-Instruct turn. These checkpoints'
generation configs do not list the turn end, and vLLM has no per-model hook for it.

How: wrap the method: when the served config carries ``diffspec_stop_token_ids`` (set only by
diffspec's Fast-dLLM config hook, :mod:`diffspec.plugin.vllm.dllm`), the returned
``eos_token_id`` becomes the generation config's ids followed by those; every other model
gets vLLM's answer unchanged. The input processor reads it once, at start-up.
"""

from __future__ import annotations

from typing import Any

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply", "with_stop_ids"]

TARGETS = (
    Target("vllm.config.model", "ModelConfig.try_get_generation_config", ("self",),
           relies_on=(("vllm.v1.engine.input_processor:InputProcessor.__init__",
                       "self.generation_config_fields = "
                       "model_config.try_get_generation_config()"),)),
)

ATTRIBUTE = "diffspec_stop_token_ids"


def with_stop_ids(generation_config: dict[str, Any], stop_ids: list[int]) -> dict[str, Any]:
    """``generation_config`` with ``stop_ids`` appended to its ``eos_token_id`` (int or
    list), without repeats."""
    eos = generation_config.get("eos_token_id")
    current = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return {**generation_config, "eos_token_id": list(dict.fromkeys([*current, *stop_ids]))}


def apply() -> None:
    from vllm.config.model import ModelConfig

    original = ModelConfig.try_get_generation_config
    if is_applied(original):
        return

    def try_get_generation_config(self) -> dict[str, Any]:
        config = original(self)
        stop_ids = getattr(getattr(self, "hf_config", None), ATTRIBUTE, None)
        return with_stop_ids(config, list(stop_ids)) if stop_ids else config

    try_get_generation_config.__doc__ = original.__doc__
    ModelConfig.try_get_generation_config = mark(try_get_generation_config, __name__)
