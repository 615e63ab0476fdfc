"""Patch: ``compile_or_warm_up_model`` of vLLM's workers (``vllm.v1.worker.cpu_worker.
CPUWorker`` and ``vllm.v1.worker.gpu_worker.Worker``).

Why: the adaptive draft-count policy (on by default) prices each step from a latency profile
of this model on this machine, which only the engine process can measure faithfully (its
own forwards, attention backend, compiled graphs, threads). vLLM offers no hook after its
warm-up, where the engine profiles memory and captures graphs.

How: after the worker's own warm-up (graphs captured, kernels warmed), when the runner's
drafter has ``measure_latency_profile`` (diffspec's proposers), call it with the runner:
it times the runner's own dummy forwards (``_dummy_run``, which writes no KV: slot mapping
-1) or takes the profile from diffspec's cache, then the worker's random seed is reset as
vLLM's warm-up leaves it. Any other drafter, or none, takes vLLM's path unchanged.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model", ("self",)),
    Target("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model", ("self",)),
    # the proposer's timing forwards (diffspec.spec_workers.vllm.proposer.measure_profile)
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._dummy_run",
           ("self", "num_tokens", "cudagraph_runtime_mode", "force_attention",
            "uniform_decode", "allow_microbatching", "skip_eplb", "is_profile",
            "create_mixed_batch", "remove_lora", "is_graph_capturing", "num_active_loras",
            "profile_seq_lens", "randomize_inputs"),
           relies_on=(("vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_run",
                       "sm.fill_(-1)"),)),
)


def _wrap(cls) -> None:
    original = cls.compile_or_warm_up_model
    if is_applied(original):
        return

    @functools.wraps(original)
    def compile_or_warm_up_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        measure = getattr(getattr(runner, "drafter", None), "measure_latency_profile", None)
        if measure is not None:
            from vllm.utils.torch_utils import set_random_seed

            measure(runner)
            set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return result

    cls.compile_or_warm_up_model = mark(compile_or_warm_up_model, __name__)


def apply() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    _wrap(CPUWorker)
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:  # a build without the GPU worker's dependencies
        return
    _wrap(Worker)
