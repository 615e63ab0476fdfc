"""Patch: ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``.

Why: vLLM validates ``speculative_config["method"]`` against a closed ``Literal``, so
``{"method": "orthrus"}`` is rejected before any plugin code runs, and its one open hook
(``method="custom_class"``) asks users to type a class path.

How: wrap the method that turns the user's dict (``--speculative-config`` /
``LLM(speculative_config=...)``, plus the ``--spec-method`` flags) into a
``SpeculativeConfig``. For diffspec's methods the dict is checked against the served
checkpoint and rewritten to the ``custom_class`` hook
(:func:`diffspec.plugin.vllm.config.translate_speculative_config`), the engine options the
drafter cannot work with are refused here, in the process the user launched, and the
attention config asks for a backend that attends non-causally (``use_non_causal``: vLLM's
selector then refuses an unfit backend at load); for ``tidar``, a
``max_num_batched_tokens`` that cannot hold one request's step with its branch rows
(:func:`~diffspec.plugin.vllm.config.budget_error`) is refused. An unknown
method name gets an error listing vLLM's methods and diffspec's. Anything else goes to
vLLM untouched.
"""

from __future__ import annotations

import functools
import logging
from typing import get_args

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

# what this patch relies on in vLLM (checked per listed version: tests/unit/test_engine_sources.py)
TARGETS = (
    Target("vllm.engine.arg_utils", "EngineArgs.create_speculative_config",
           ("self", "target_model_config", "target_parallel_config"),
           relies_on=(
               # the user's speculative / attention / compilation settings are read after
               # this method rewrote them
               ("vllm.engine.arg_utils:EngineArgs.create_engine_config",
                "speculative_config = self.create_speculative_config( ... "
                "attention_config = copy.deepcopy(self.attention_config) ... "
                "compilation_config = copy.deepcopy(self.compilation_config)"),
               ("vllm.engine.arg_utils:EngineArgs.create_engine_config",
                "speculative_config = self.create_speculative_config( ... "
                "async_scheduling=self.async_scheduling"),
               ("vllm.config.attention:AttentionConfig", "use_non_causal: bool = False"),
               ("vllm.config.compilation:CompilationConfig",
                "cudagraph_mode: CUDAGraphMode = None"),
               # the backends a launch names (config.named_backends, read by this patch and
               # the diffusion config hooks): a per-kind entry replaces the global one
               ("vllm.v1.attention.selector:get_attn_backend",
                "backend = attention_config.backend if attention_config.backend_per_kind: "
                "... backend = attention_config.backend_per_kind.get(kind.value, backend)"),
           )),
)

logger = logging.getLogger("vllm.diffspec")  # under vLLM's logger: its handlers and level


def _vllm_methods() -> set[str]:
    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp) -> set[str]:
        args = get_args(tp)
        return {tp} if not args else set().union(*(flatten(a) for a in args))

    return flatten(SpeculativeMethod)


def _merged_flags(args) -> dict | None:
    """The user's speculative config with ``--spec-method/--spec-model/--spec-tokens``
    folded in, as vLLM itself does."""
    spec = None if args.speculative_config is None else dict(args.speculative_config)
    for flag, key, value in (
        ("--spec-method", "method", getattr(args, "spec_method", None)),
        ("--spec-model", "model", getattr(args, "spec_model", None)),
        ("--spec-tokens", "num_speculative_tokens", getattr(args, "spec_tokens", None)),
    ):
        if value is None:
            continue
        spec = {} if spec is None else spec
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    if spec is None:
        return None
    return {k.replace("-", "_"): v for k, v in spec.items()}


def _check_engine(target_model_config, target_parallel_config, method: str) -> None:
    """Engine options the self-speculative drafter cannot run under."""
    if target_parallel_config.pipeline_parallel_size > 1:
        raise ValueError(f"method {method!r} runs the whole model in its draft pass; pipeline "
                         f"parallelism is not supported (use tensor parallelism)")
    if getattr(target_parallel_config, "decode_context_parallel_size", 1) > 1:
        raise ValueError(f"method {method!r} does not support decode context parallelism")


def _v2_runner() -> bool:
    """Whether vLLM will run the V2 model runner: only when VLLM_USE_V2_MODEL_RUNNER=1 (left
    unset, vLLM picks the V1 runner for a ``custom_class`` speculative config)."""
    from vllm import envs

    return envs.VLLM_USE_V2_MODEL_RUNNER is True


def _restrict_v2(args, target_parallel_config, method: str, spec: dict) -> dict:
    """What the V2 runner's speculator (patch ``v2_speculator``) runs under, checked here
    before any weights load: one tensor-parallel rank, a fixed draft count
    (``"adaptive"`` off), async scheduling off (docs/gpu-support.md, V11 / V12). Returns
    ``spec`` with ``"adaptive": false``."""
    if target_parallel_config.tensor_parallel_size > 1:
        raise ValueError(f"set tensor_parallel_size to 1, or unset VLLM_USE_V2_MODEL_RUNNER "
                         f"(the V1 runner serves method {method!r} with tensor parallelism): "
                         f"diffspec's V2-runner speculator is checked on one rank only")
    if spec.get("adaptive") or spec.get("latency_profile"):
        raise ValueError(
            f"set \"adaptive\": false (or leave it out) and remove \"latency_profile\" for "
            f"method {method!r} on vLLM's V2 model runner, or unset VLLM_USE_V2_MODEL_RUNNER: "
            f"the V2 runner verifies num_speculative_tokens drafts per request every step (its "
            f"scheduler fixes the count), so a per-step draft count has nothing to change")
    if spec.get("prompt_lookup"):
        raise ValueError(
            f"remove \"prompt_lookup\" (or set it false) for method {method!r} on vLLM's V2 "
            f"model runner, or unset VLLM_USE_V2_MODEL_RUNNER: the V2 runner verifies "
            f"num_speculative_tokens drafts per request every step, and a lookup match's "
            f"continuation is often shorter")
    if args.async_scheduling:
        raise ValueError(
            f"add --no-async-scheduling (or leave it out) for method {method!r} on vLLM's V2 "
            f"model runner: diffspec's V2 speculator is checked with synchronous scheduling "
            f"only (vLLM's CPU serving; docs/gpu-support.md, V12)")
    args.async_scheduling = False
    logger.info("diffspec: method %r runs as a speculator of vLLM's V2 model runner "
                "(VLLM_USE_V2_MODEL_RUNNER=1) with num_speculative_tokens drafts every step "
                "(no adaptive draft counts) and async scheduling off", method)
    return {**spec, "adaptive": False}


def _require_non_causal(args, method: str) -> None:
    """diffspec's drafters attend non-causally over the paged KV cache: ask vLLM's backend
    selector for a backend that can (``attention_config.use_non_causal``), refuse a named
    backend diffspec has not checked (:func:`~diffspec.plugin.vllm.config.
    attention_backend_error`: FlashInfer, for one; the global backend and every per-kind one
    of ``backend_per_kind``, which overrides it), and on a GPU name TRITON_ATTN when the
    user named none (:func:`~diffspec.plugin.vllm.config.gpu_default_backend`): the backend
    whose own kernels ran the methods here, rather than vLLM's FLASH_ATTN / FlashInfer."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from diffspec.plugin.vllm.config import (
        attention_backend_error,
        gpu_default_backend,
        named_backends,
        per_kind_note,
    )

    config = args.attention_config
    named = named_backends(config, args.attention_backend)  # the per-kind ones too
    for where, name in named:
        try:
            backend = AttentionBackendEnum[name].get_class()
        except (ImportError, KeyError):  # not on this platform: vLLM's own error follows
            backend = None
        if backend is not None and not backend.supports_non_causal():
            raise ValueError(
                f"use an attention backend that attends non-causally (CPU_ATTN on CPU, "
                f"TRITON_ATTN on GPU): method {method!r} drafts with non-causal attention "
                f"over the paged KV cache, which {backend.get_name()} cannot do"
                f"{per_kind_note(where)}")
        error = attention_backend_error(method, name)
        if error:
            raise ValueError(error + per_kind_note(where))
    default = gpu_default_backend(named, current_platform.is_cuda_alike())
    if default is not None and hasattr(config, "backend"):
        args.attention_backend = None  # "auto": the one below, not both
        config.backend = AttentionBackendEnum[default]
        logger.info("diffspec: method %r runs on attention backend %s (its Triton kernels ran "
                    "the method's draft and verify attention in diffspec's tests; name "
                    "another with --attention-backend, e.g. FLASH_ATTN)", method, default)
    if hasattr(config, "use_non_causal"):
        config.use_non_causal = True


def _cudagraphs(args, method: str, spec: dict, v2: bool) -> None:
    """Full CUDA graphs off where the method cannot run under them
    (:func:`~diffspec.plugin.vllm.config.cudagraph_plan`), with one log line."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.platforms import current_platform

    from diffspec.plugin.vllm.config import cudagraph_plan, diffspec_options

    if isinstance(args.compilation_config, dict):
        args.compilation_config = CompilationConfig(**args.compilation_config)
    compilation = args.compilation_config
    mode = getattr(compilation, "cudagraph_mode", None)
    options = diffspec_options(spec)  # adaptive counts or lookup drafts: varying verifies
    plan = cudagraph_plan(method, options["adaptive"] or bool(options["prompt_lookup"]),
                          None if mode is None else getattr(mode, "name", str(mode)),
                          bool(args.enforce_eager), current_platform.is_cuda_alike(),
                          v2_runner=v2)
    if plan == "NONE":
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        logger.warning("diffspec: method %r runs with cudagraph_mode NONE on vLLM's V2 model "
                       "runner: its branches join the target forward in the model's Python "
                       "forward, which a CUDA graph replay would skip. Cost: kernel launch "
                       "overhead in every layer, most visible at small batches (the V1 "
                       "runner, VLLM_USE_V2_MODEL_RUNNER unset, runs it with PIECEWISE "
                       "graphs)", method)
    elif plan is not None:
        compilation.cudagraph_mode = CUDAGraphMode[plan]
        logger.warning("diffspec: method %r runs with cudagraph_mode %s (CUDA graphs for "
                       "the layers between attention calls, attention eager): %s. Cost: "
                       "kernel launch overhead in attention, most visible at small batches",
                       method, plan,
                       "its branches' metadata are built before they run" if method == "tidar"
                       else "its V2-runner draft pass builds attention metadata on the "
                       "target's builders between graph replays" if v2
                       else "adaptive draft counts and prompt-lookup drafts change the "
                       "verify length every step")


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from diffspec.plugin.vllm.config import (
        budget_error,
        diffspec_options,
        self_spec_methods,
        translate_speculative_config,
        unknown_method_message,
    )

    original = EngineArgs.create_speculative_config
    if is_applied(original):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = _merged_flags(self)
        method = None if spec is None else spec.get("method")
        if isinstance(method, str) and method in self_spec_methods():
            _check_engine(target_model_config, target_parallel_config, method)
            v2 = _v2_runner()
            if v2:
                spec = _restrict_v2(self, target_parallel_config, method, spec)
            _require_non_causal(self, method)
            _cudagraphs(self, method, spec, v2)
            if not v2:
                logger.info(
                    "diffspec: method %r runs as vLLM's custom proposer, which vLLM runs on "
                    "its V1 model runner with async scheduling off (vLLM 0.33 runs other "
                    "models on the V2 runner with async scheduling: expect a lower step rate "
                    "at small batches; VLLM_USE_V2_MODEL_RUNNER=1 runs orthrus / "
                    "linear_self_spec on the V2 runner)", method)
            hf_config = target_model_config.hf_config.to_dict()
            self.speculative_config = translate_speculative_config(
                spec, target_model_config.model, hf_config)
            if method == "tidar":  # its branch rows are reserved in the token budget
                error = budget_error(self.max_num_batched_tokens,
                                     self.speculative_config["num_speculative_tokens"],
                                     hf_config.get("dlm_type") == "dream")
                if error:
                    raise ValueError(error)
            self.additional_config = {**(self.additional_config or {}),
                                      "diffspec": diffspec_options(spec)}
            self.spec_method = self.spec_model = self.spec_tokens = None
        elif isinstance(method, str) and method not in _vllm_methods():
            raise ValueError(unknown_method_message(method, _vllm_methods()))
        return original(self, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = mark(create_speculative_config, __name__)
