"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens`` (worker side,
inherited by the CPU runner) and ``vllm.v1.executor.multiproc_executor.MultiprocExecutor``'s
``execute_model`` / ``sample_tokens`` / ``take_draft_token_ids`` (engine-core side).

Why: without async scheduling (always on CPU; on GPU for every diffspec method, which
vLLM's ``custom_class`` hook runs synchronously) the engine core asks the worker for the
step's drafts with a separate RPC after every step (``EngineCore.post_step`` ->
``take_draft_token_ids``), although the worker computed them before it returned the step's
output (the drafter runs inside ``sample_tokens``). Under ``MultiprocExecutor`` (vLLM's
layout on CPU, offline and server alike, and with tensor parallelism) that is one more
hand-off per step between the engine core and the worker processes, which a plain AR step
does not pay. Measured through ``vllm serve`` (2-core CPU, the embedded default, 64 GSM8K
requests at concurrency 16, py-spy): 47 of ~3,270 worker samples in that RPC, plus the
hand-off itself, which no process was sampled computing.

How: when the runner's drafter is diffspec's (``propose_with_runner``) and the step's
output is a plain ``ModelRunnerOutput`` (sync scheduling) of a ``MultiprocExecutor``
worker (``distributed_executor_backend == "mp"``), the worker reads its drafts
with vLLM's own ``take_draft_token_ids`` at the end of ``sample_tokens`` and sends them on
the output (attribute ``diffspec_draft_token_ids``: a one-tuple, ``(None,)`` when there are
none). The executor keeps them from that output for this step and answers the engine core's
``take_draft_token_ids`` with them instead of an RPC; every ``execute_model`` clears what it
kept, so a step whose output carried none (another drafter, a KV-connector output, an
output of ``execute_model`` itself) takes vLLM's RPC as before. The drafts are the ones the
RPC would have returned: nothing runs on the worker between the end of ``sample_tokens``
and that RPC. Under ``UniProcExecutor`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which calls
the worker in-process, both halves leave vLLM's path as it is.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["ATTRIBUTE", "TARGETS", "apply"]

ATTRIBUTE = "diffspec_draft_token_ids"  # on the worker's ModelRunnerOutput
_KEPT = "_diffspec_kept_drafts"  # on the executor: this step's drafts, or None

TARGETS = (
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens",
           ("self", "grammar_output"),
           relies_on=(("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
                       ("if draft_after_bookkeeping: ... propose_draft_token_ids("
                        "valid_sampled_token_ids) ... if not self.use_async_scheduling: "
                        "return output")),
                      ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids",
                       "draft_token_ids, req_ids = self._get_draft_token_ids_cpu()"))),
    Target("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.execute_model",
           ("self", "scheduler_output", "non_block")),
    Target("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.sample_tokens",
           ("self", "grammar_output", "non_block")),
    Target("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.take_draft_token_ids",
           ("self",),
           relies_on=(("vllm.v1.engine.core:EngineCore.step",
                       ("future = self.model_executor.execute_model(scheduler_output, "
                        "non_block=True) ... model_output = "
                        "self.model_executor.sample_tokens(grammar_output)")),
                      ("vllm.v1.engine.core:EngineCore.post_step",
                       "draft_token_ids = self.model_executor.take_draft_token_ids()"))),
)


def apply() -> None:
    _patch_runner()
    _patch_executor()


def _patch_runner() -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.sample_tokens
    if is_applied(original):
        return

    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        output = original(self, grammar_output)
        if (type(output) is ModelRunnerOutput and output is not EMPTY_MODEL_RUNNER_OUTPUT
                and not self.use_async_scheduling
                # another process asks for the drafts (in-process, the RPC costs nothing)
                and self.parallel_config.distributed_executor_backend == "mp"
                and hasattr(getattr(self, "drafter", None), "propose_with_runner")):
            drafts = self.take_draft_token_ids()
            if drafts is not None:  # its req_ids may be the batch's live list: a copy
                drafts = DraftTokenIds(list(drafts.req_ids), drafts.draft_token_ids)
            setattr(output, ATTRIBUTE, (drafts,))
        return output

    GPUModelRunner.sample_tokens = mark(sample_tokens, __name__)


def _patch_executor() -> None:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if is_applied(MultiprocExecutor.take_draft_token_ids):
        return
    execute_model = MultiprocExecutor.execute_model
    sample = MultiprocExecutor.sample_tokens
    take = MultiprocExecutor.take_draft_token_ids

    @functools.wraps(execute_model)
    def execute_model_(self, scheduler_output, non_block=False):
        setattr(self, _KEPT, None)  # a new step: nothing kept from the last one
        return execute_model(self, scheduler_output, non_block)

    @functools.wraps(sample)
    def sample_tokens(self, grammar_output, non_block=False):
        output = sample(self, grammar_output, non_block)
        carried = getattr(output, "__dict__", {}).pop(ATTRIBUTE, None)  # a Future: none
        setattr(self, _KEPT, carried)
        return output

    @functools.wraps(take)
    def take_draft_token_ids(self):
        kept = getattr(self, _KEPT, None)
        setattr(self, _KEPT, None)
        if kept is not None:
            return kept[0]
        return take(self)

    MultiprocExecutor.execute_model = mark(execute_model_, __name__)
    MultiprocExecutor.sample_tokens = mark(sample_tokens, __name__)
    MultiprocExecutor.take_draft_token_ids = mark(take_draft_token_ids, __name__)
