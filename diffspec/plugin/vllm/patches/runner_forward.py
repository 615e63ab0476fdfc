"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward`` (inherited by
the CPU runner).

Why: TiDAR / NLD quadratic self-speculation drafts in the verify forward itself (one
forward per step): the forward must also run one branch of mask tokens per acceptance
outcome, with its own attention metadata over the runner's paged cache. vLLM offers a
``custom_class`` proposer no say in the target's forward.

How: when the runner's drafter has ``forward_with_runner`` (diffspec's ``TiDARProposer``),
call ``drafter.forward_with_runner(runner, fallback, **forward_args)``, which returns the
hidden states of the runner's tokens as the model's forward would (``fallback`` runs the
model's own forward, for steps without branches); every other drafter, and every runner
without one, takes vLLM's path unchanged.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward",
           ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
            "**model_kwargs"),
           # the runner calls it with keywords only (the patch passes positional calls on)
           relies_on=(("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
                       "self._model_forward( input_ids=input_ids, positions=positions, "
                       "intermediate_tensors=intermediate_tensors, "
                       "inputs_embeds=inputs_embeds, **model_kwargs, )"),)),
)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward
    if is_applied(original):
        return

    @functools.wraps(original)
    def _model_forward(self, *args, **kwargs):
        forward = getattr(getattr(self, "drafter", None), "forward_with_runner", None)
        if forward is None or args:
            return original(self, *args, **kwargs)
        return forward(self, lambda: original(self, **kwargs), **kwargs)

    GPUModelRunner._model_forward = mark(_model_forward, __name__)
