"""Patch: ``vllm.v1.engine.input_processor.InputProcessor.process_inputs``.

Why: ReFusion on vLLM's diffusion path decodes a request's whole generation in the canvas
vLLM schedules for it (``max_tokens`` rounded up to whole slots, split into the serial
blocks, after the prompt, within ``max_model_len``). A request that does not fit cannot be
decoded the reference's way, and the model state in the worker cannot refuse one request
(an error there stops the engine; emitting nothing would leave it running forever). vLLM
checks a diffusion request's ``extra_args`` at admission but has no per-model hook for it.

Fast-dLLM and ReFusion decode greedily by their own rules, while vLLM's diffusion path
(``SamplingParams._validate_diffusion``) takes temperature 1.0 only and refuses a seed,
with a message that does not say what to do: a client asking for greedy decoding
(temperature 0), which is what these methods do, would be refused, and a sampling value
they would ignore (top_p, penalties) would pass.

How: wrap the method. Before vLLM's checks, when the served config names a diffspec
diffusion method (``hf_config.diffspec_diffusion_method``, set only by diffspec's
Fast-dLLM and ReFusion config hooks), a request with a sampling value the method cannot
honour raises ``VLLMValidationError`` (HTTP 400) whose first words say what to do
(:func:`diffspec.plugin.vllm.dllm.diffusion_request_error`); temperature 0 (greedy) and a
seed, which greedy decoding honours, reach vLLM's check as its default temperature 1.0
and no seed, on a copy of the request's parameters. After vLLM's own checks, when the served config carries the ReFusion
settings (``hf_config.diffspec_refusion``, set only by diffspec's ReFusion config hook,
:mod:`diffspec.plugin.vllm.refusion`), a request ReFusion cannot decode raises vLLM's
``VLLMValidationError`` (HTTP 400, that request only) whose first words say what to do
(:func:`diffspec.plugin.vllm.refusion.refusion_request_error`). Fast-dLLM likewise
(``hf_config.diffspec_fast_dllm``, set only by its config hook,
:mod:`diffspec.plugin.vllm.dllm`): a request with a canvas width of its own
(``diffusion_canvas_length``) other than the served block is refused
(:func:`diffspec.plugin.vllm.dllm.fast_dllm_request_error`), where vLLM's diffusion
scheduler would schedule that width and the sampler would wait for a whole block forever.
Every other model and request passes through untouched.
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
                       "prompt_len )"),
                      ("vllm.sampling_params:SamplingParams._validate_diffusion",
                       "if ( self.temperature != 1.0 or self.min_p > _SAMPLING_EPS or "
                       "self.seed is not None"))),
)


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from diffspec.plugin.vllm.dllm import ATTRIBUTE as FAST_DLLM
    from diffspec.plugin.vllm.dllm import (
        METHOD_ATTRIBUTE,
        diffusion_request_error,
        fast_dllm_request_error,
    )
    from diffspec.plugin.vllm.refusion import ATTRIBUTE, refusion_request_error

    original = InputProcessor.process_inputs
    if is_applied(original):
        return

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        method = getattr(self.model_config.hf_config, METHOD_ATTRIBUTE, None)
        if method and isinstance(params, SamplingParams):
            error = diffusion_request_error(params, method)
            if error:
                raise VLLMValidationError(error)
            if params.temperature != 1.0 or params.seed is not None:
                params = params.clone()  # greedy either way: vLLM's diffusion check's values
                params.temperature, params.seed = 1.0, None
        request = original(self, request_id, prompt, params, *args, **kwargs)
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
        fast_dllm = getattr(self.model_config.hf_config, FAST_DLLM, None)
        if fast_dllm and params is not None:
            error = fast_dllm_request_error(params.extra_args, int(fast_dllm["block_size"]))
            if error:
                raise VLLMValidationError(error, parameter="extra_args",
                                          value=params.extra_args)
        return request

    process_inputs.__doc__ = original.__doc__
    InputProcessor.process_inputs = mark(process_inputs, __name__)
