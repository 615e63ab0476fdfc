"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids``
(inherited by the CPU runner).

Why: vLLM hands a ``custom_class`` proposer the sampled token ids only; the diffusion
view needs the runner's paged-KV state (block table, attention metadata builders of the
target's layers, per-request ``max_tokens``) to run the target's own layers on its cache.

How: when the runner's drafter is a diffspec self-speculative proposer (it has
``propose_with_runner``), call ``drafter.propose_with_runner(runner, sampled_token_ids)``
instead of ``drafter.propose(...)``; every other drafter takes vLLM's path unchanged.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids",
           ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
            "hidden_states", "sample_hidden_states", "aux_hidden_states",
            "spec_decode_metadata", "common_attn_metadata", "slot_mappings"),
           relies_on=(("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
                       "self._draft_probs: torch.Tensor | None = None ... "
                       "self._draft_prob_req_ids: list[str] | None = None"),)),
)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if is_applied(original):
        return

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        propose = getattr(getattr(self, "drafter", None), "propose_with_runner", None)
        if propose is None:
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        self._draft_probs = None  # point-mass drafts: vLLM's rejection sampler needs no q
        self._draft_prob_req_ids = None
        return propose(self, sampled_token_ids)

    GPUModelRunner.propose_draft_token_ids = mark(propose_draft_token_ids, __name__)
