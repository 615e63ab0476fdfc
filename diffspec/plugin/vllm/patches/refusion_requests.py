"""Patch: ``vllm.v1.engine.input_processor.InputProcessor.process_inputs``.

Why: ReFusion on vLLM's diffusion path decodes a request's whole generation in the canvas
vLLM schedules for it (``max_tokens`` rounded up to whole slots, split into the serial
blocks, after the prompt, within ``max_model_len``). A request that does not fit cannot be
decoded the reference's way, and the model state in the worker cannot refuse one request
(an error there stops the engine; emitting nothing would leave it running forever). vLLM
checks a diffusion request's ``extra_args`` at admission but has no per-model hook for it.

How: wrap the method: after vLLM's own checks, when the served config carries the ReFusion
settings (``hf_config.diffspec_refusion``, set only by diffspec's ReFusion config hook,
:mod:`diffspec.plugin.vllm.refusion`), a request ReFusion cannot decode raises vLLM's
``VLLMValidationError`` (HTTP 400, that request only) whose first words say what to do
(:func:`diffspec.plugin.vllm.refusion.refusion_request_error`); every other model and
request passes through untouched.
"""

from __future__ import annotations

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.v1.engine.input_processor", "InputProcessor.process_inputs",
           ("self", "request_id", "prompt", "params", "supported_tasks", "arrival_time",
            "lora_request", "tokenization_kwargs", "trace_headers", "priority",
            "data_parallel_rank", "resumable", "session_id", "kv_hints"),
           relies_on=(("vllm.v1.engine.input_processor:InputProcessor.process_inputs",
                       "sampling_params.max_tokens = ( self.model_config.max_model_len - "
                       "prompt_len )"),)),
)


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from diffspec.plugin.vllm.refusion import ATTRIBUTE, refusion_request_error

    original = InputProcessor.process_inputs
    if is_applied(original):
        return

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        settings = getattr(self.model_config.hf_config, ATTRIBUTE, None)
        params = request.sampling_params
        if settings and params is not None:
            width = (params.extra_args or {}).get("diffusion_canvas_length")
            error = refusion_request_error(len(request.prompt_token_ids or ()),
                                           int(params.max_tokens), settings,
                                           self.model_config.max_model_len, width)
            if error:
                raise VLLMValidationError(error, parameter="max_tokens",
                                          value=params.max_tokens)
        return request

    process_inputs.__doc__ = original.__doc__
    InputProcessor.process_inputs = mark(process_inputs, __name__)
