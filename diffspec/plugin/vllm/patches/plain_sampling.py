"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample`` (inherited by the CPU
runner).

Why: with a speculative config, vLLM's V1 runner builds speculative metadata for every
step and samples through its ``RejectionSampler`` even when no request has a draft: it
copies the batch's logits (``logits[bonus_logits_indices]``, ``[num_reqs, vocab]``),
samples them as bonus tokens and runs the rejection kernels over zero drafts. diffspec's
adaptive policy makes many steps draft nothing (every step, at high load); those steps
should cost what a plain AR step costs. Measured (vLLM CPU, the embedded default, GSM8K,
32 requests in flight, no request drafting): 128 of 128 steps went through the rejection
sampler with 0 drafts, about 4% of the engine's time.

How: when the runner's drafter is diffspec's (it has ``propose_with_runner``) and the
step's ``spec_decode_metadata`` holds no draft token (``max_spec_len == 0``), call the
original with ``spec_decode_metadata=None``: vLLM's own plain path (``self.sampler`` on
the logits, which with zero drafts are the same rows, one per request). The sampled ids
have the shape the rejection sampler returns with zero drafts (``[num_reqs, 1]``), which
the runner's bookkeeping reads as "no spec decode tokens"; it is the sampling an AR step
does (same sampler, same logits processors, same generators), so outputs stay AR's. Steps
with drafts and every other drafter take vLLM's path unchanged.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample",
           ("self", "logits", "spec_decode_metadata"),
           relies_on=(("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
                       "if spec_decode_metadata is None: return self.sampler( "
                       "logits=logits, sampling_metadata=sampling_metadata, )"),
                      ("vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
                       "self.max_spec_len = max(self.num_draft_tokens)"))),
)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if is_applied(original):
        return

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0
                and hasattr(getattr(self, "drafter", None), "propose_with_runner")):
            spec_decode_metadata = None  # no drafts this step: sample as an AR step does
        return original(self, logits, spec_decode_metadata)

    GPUModelRunner._sample = mark(_sample, __name__)
