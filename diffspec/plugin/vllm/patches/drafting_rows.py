"""Patch: the property ``vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting``.

Why: a ``tidar`` step forwards, besides the tokens the scheduler scheduled, up to
``(K + 1)(K + skip)`` branch rows per request in the same forward
(:mod:`diffspec.spec_workers.vllm.tidar`). vLLM sizes the KV cache from a memory profile
that forwarded ``max_num_batched_tokens`` rows (``profile_run`` ->
``_dummy_run(self.max_num_tokens)``, on both model runners), so unreserved branch rows would
be activations outside that accounting (an OOM on a loaded GPU). vLLM reserves such rows
per scheduled request for its own drafters that append rows to a forward (PARD, P-EAGLE),
in this one property; the custom_class hook gets 0.

How: wrap the property's getter: the ``tidar`` branch rows for diffspec's ``tidar`` config
(:func:`diffspec.plugin.vllm.config.drafting_rows`), vLLM's own answer otherwise. The
scheduler subtracts it from the step's input budget (``max_num_batched_tokens``) for every
request it schedules, so the scheduled tokens plus every request's branch rows never exceed
the profiled rows.
"""

from __future__ import annotations

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.config.speculative", "SpeculativeConfig.max_num_new_slots_for_drafting",
           ("self",), is_property=True,
           relies_on=(
               # each scheduled request takes its tokens plus these rows from the budget
               ("vllm.v1.core.sched.scheduler:Scheduler.schedule",
                "draft_slots = spec.max_num_new_slots_for_drafting if spec is not None else 0 "
                "input_budget = self.scheduler_config.max_num_batched_tokens ... "
                "input_budget -= num_new_tokens + draft_slots"),
               # the budget is the row count the memory profile forwards (V1 and V2 runners)
               ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
                "self.max_num_tokens = scheduler_config.max_num_batched_tokens"),
               ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run",
                "self._dummy_run( self.max_num_tokens, is_profile=True"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.__init__",
                "self.max_num_tokens = self.scheduler_config.max_num_batched_tokens"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.profile_run",
                "self._dummy_run( self.max_num_tokens,"),
           )),
)


def apply() -> None:
    from vllm.config.speculative import SpeculativeConfig

    from diffspec.plugin.vllm.config import drafting_rows

    original = SpeculativeConfig.max_num_new_slots_for_drafting
    if is_applied(original.fget):
        return

    def max_num_new_slots_for_drafting(self) -> int:
        rows = drafting_rows(self)
        return original.fget(self) if rows is None else rows

    max_num_new_slots_for_drafting.__doc__ = original.__doc__
    SpeculativeConfig.max_num_new_slots_for_drafting = property(
        mark(max_num_new_slots_for_drafting, __name__))
