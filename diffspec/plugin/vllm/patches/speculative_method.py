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
selector then refuses an unfit backend at load). An unknown
method name gets an error listing vLLM's methods and diffspec's. Anything else goes to
vLLM untouched.
"""

from __future__ import annotations

import functools
from typing import get_args

from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["apply"]


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
    from vllm import envs

    if target_parallel_config.pipeline_parallel_size > 1:
        raise ValueError(f"method {method!r} runs the whole model in its draft pass; pipeline "
                         f"parallelism is not supported (use tensor parallelism)")
    if getattr(target_parallel_config, "decode_context_parallel_size", 1) > 1:
        raise ValueError(f"method {method!r} does not support decode context parallelism")
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(f"method {method!r} runs in vLLM's V1 model runner; unset "
                         f"VLLM_USE_V2_MODEL_RUNNER")


def _require_non_causal(args, method: str) -> None:
    """diffspec's drafters attend non-causally over the paged KV cache: ask vLLM's backend
    selector for a backend that can (``attention_config.use_non_causal``), so an unfit
    backend is refused when the model loads, not at the first draft; one the user named is
    refused here, before anything loads."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = args.attention_config
    named = args.attention_backend or getattr(config, "backend", None)
    if named is not None:
        try:
            backend = (AttentionBackendEnum[named] if isinstance(named, str)
                       else named).get_class()
        except (ImportError, KeyError):  # not on this platform: vLLM's own error follows
            backend = None
        if backend is not None and not backend.supports_non_causal():
            raise ValueError(
                f"use an attention backend that attends non-causally (CPU_ATTN on CPU, "
                f"FLASH_ATTN on GPU): method {method!r} drafts with non-causal attention over "
                f"the paged KV cache, which {backend.get_name()} cannot do")
    if hasattr(config, "use_non_causal"):
        config.use_non_causal = True


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from diffspec.plugin.vllm.config import (
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
            _require_non_causal(self, method)
            hf_config = target_model_config.hf_config.to_dict()
            self.speculative_config = translate_speculative_config(
                spec, target_model_config.model, hf_config)
            self.additional_config = {**(self.additional_config or {}),
                                      "diffspec": diffspec_options(spec)}
            self.spec_method = self.spec_model = self.spec_tokens = None
        elif isinstance(method, str) and method not in _vllm_methods():
            raise ValueError(unknown_method_message(method, _vllm_methods()))
        return original(self, target_model_config, target_parallel_config)

    EngineArgs.create_speculative_config = mark(create_speculative_config, __name__)
