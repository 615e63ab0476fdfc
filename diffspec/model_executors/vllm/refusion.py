"""A ReFusion checkpoint on vLLM's diffusion path: vLLM's own Qwen3 (a ReFusion checkpoint is
a stock causal Qwen3 fine-tune) naming its model state,
:class:`diffspec.spec_workers.vllm.refusion.ReFusionModelState`, the way
``DiffusionGemmaForConditionalGeneration`` does. The plugin's config hook
(:mod:`diffspec.plugin.vllm.refusion`) names this class only under ``--diffusion-config``.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

__all__ = ["ReFusionForCausalLM", "refusion_model_state_cls"]


def refusion_model_state_cls() -> type:
    """The model state (imported lazily: it needs the V2 runner's modules)."""
    from diffspec.spec_workers.vllm.refusion import ReFusionModelState

    return ReFusionModelState


class ReFusionForCausalLM(Qwen3ForCausalLM):
    """vLLM's Qwen3, unchanged; with ``diffusion_config`` set it names ReFusion's model state
    (vLLM's V2 runner asks ``get_model_state_cls``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if vllm_config.diffusion_config is not None:
            self.get_model_state_cls = refusion_model_state_cls
