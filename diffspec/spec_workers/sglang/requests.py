"""Per-request checks of diffspec's SGLang workers: what a request asks that a method cannot
honour, as a message whose first words say what to do. A worker refuses such a request alone
(SGLang aborts it with the message; the rest of the batch runs on). No torch or SGLang import
at import time, so the unit tier checks the messages.
"""

from __future__ import annotations

import logging
from typing import Any

from diffspec.methods import get_method

__all__ = ["FAST_DLLM", "REFUSION", "fast_dllm_request_error", "refuse_unsupported_requests",
           "ignored_fields", "logprobs_error", "refusion_request_error", "sampling_asked",
           "unsupported_request_option"]

logger = logging.getLogger("diffspec")

FAST_DLLM = get_method("fast_dllm").sglang.name  # --dllm-algorithm FastDLLM
REFUSION = get_method("refusion").sglang.name  # --dllm-algorithm ReFusion


def unsupported_request_option(req) -> str | None:
    """What of ``req`` (an SGLang ``Req``) the self-speculative workers cannot honour, as
    the start of an error message, or ``None``."""
    params = req.sampling_params
    if req.return_logprob:
        return "drop return_logprob (or serve without --speculative-algorithm)"
    if getattr(req, "grammar", None) is not None or any(
            getattr(params, name, None) is not None
            for name in ("json_schema", "regex", "ebnf", "structural_tag")):
        return "drop json_schema / regex / ebnf / structural_tag (or serve without " \
               "--speculative-algorithm)"
    if getattr(req, "custom_logit_processor", None):
        return "drop custom_logit_processor (or serve without --speculative-algorithm)"
    return None


def refuse_unsupported_requests(batch, method: str) -> list:
    """Abort, one by one, the requests of ``batch`` with an option the worker cannot honour
    (SGLang's ``Req.to_finish``: the request finishes after this step with an ``abort``
    finish reason, HTTP 400, and this message; the other requests of the batch run on).
    As SGLang's ``Req.set_finish_with_abort`` does, a refused request computes no
    logprobs. Returns the requests refused now."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    refused = []
    for req in batch.reqs:
        if req.finished() or req.to_finish is not None:
            continue
        what = unsupported_request_option(req)
        if what is None:
            continue
        message = (f"{what[0].upper()}{what[1:]}: --speculative-algorithm {method.upper()} "
                   f"does not support it")
        logger.warning("diffspec: refusing request %s: %s", req.rid, message)
        req.to_finish = FINISH_ABORT(message, status_code=HTTPStatus.BAD_REQUEST,
                                     err_type="BadRequestError")
        req.return_logprob = False
        req.logprob_start_len = -1
        refused.append(req)
    if refused and batch.return_logprob:
        batch.return_logprob = any(req.return_logprob for req in batch.reqs)
    return refused


# sampling fields the dLLMs (FastDLLM, ReFusion) would ignore: (name, value that means "not
# asked for")
_IGNORED_FIELDS = (("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                   ("repetition_penalty", 1.0), ("min_new_tokens", 0), ("logit_bias", None),
                   ("json_schema", None), ("regex", None), ("ebnf", None),
                   ("structural_tag", None))


_TOP_K_ALL = 1 << 30  # SGLang's top_k for "the whole vocabulary" (a request's -1 or none)


def sampling_asked(params: Any) -> list[str]:
    """The sampling ``params`` (SGLang's normalized ``SamplingParams``) asks for beyond
    greedy decoding, as ``"name value"``: none for a greedy request (``top_k == 1``, how
    SGLang stores temperature 0) nor for one that sets no sampling field (SGLang's defaults:
    temperature 1, top_p 1, top_k whole vocabulary, min_p 0; diffspec's dLLM launch check
    has the OpenAI server fill a request's gaps with these, not generation_config.json's,
    :func:`diffspec.plugin.sglang.dllm.configure_dllm_server_args`)."""
    if params.top_k == 1:
        return []
    unset = {"temperature": 1.0, "top_p": 1.0, "top_k": _TOP_K_ALL, "min_p": 0.0}
    return [f"{name} {getattr(params, name, value):g}" for name, value in unset.items()
            if getattr(params, name, value) != value]


def fast_dllm_request_error(params: Any) -> str | None:
    """Why ``--dllm-algorithm FastDLLM`` refuses a request (first: what to do), or ``None``.

    ``params``: SGLang's normalized ``SamplingParams`` (greedy is ``top_k == 1``; a request
    that sets no sampling field gets SGLang's defaults, temperature 1.0 included, and is
    served: :func:`sampling_asked`). FastDLLM decodes greedily, as the reference decoder
    does, so sampling, penalties, ``min_new_tokens``, logit biases and grammars would be
    silently ignored: the request is refused instead (SGLang aborts that request alone,
    with this message)."""
    asked, ignored = sampling_asked(params), ignored_fields(params)
    if not asked and not ignored:
        return None
    todo = ([] if not asked else ["set temperature 0 (or top_k 1)"]) + (
        [f"remove {', '.join(ignored)}"] if ignored else [])
    return (f"{' and '.join(todo)} for --dllm-algorithm {FAST_DLLM}: it decodes greedily "
            f"(confidence-threshold unmasking of argmax tokens) and would ignore "
            f"{', '.join(asked + ignored)}" + (" (a request that sets no sampling field is "
                                               "served, greedily)" if asked else ""))


def logprobs_error(req: Any, how: str) -> str | None:
    """Why a dLLM (``how`` it commits tokens) refuses ``req`` (an SGLang ``Req``) asking
    for logprobs, or ``None``: SGLang's dLLM path would answer with an empty list."""
    if not getattr(req, "return_logprob", False):
        return None
    return f"leave logprobs out of the request: {how} and reports no log-probabilities for them"


def ignored_fields(params: Any) -> list[str]:
    """The fields of ``params`` (SGLang's ``SamplingParams``) set that a greedy dLLM
    would ignore: penalties, ``min_new_tokens``, a logit bias, a grammar."""
    return [name for name, unset in _IGNORED_FIELDS
            if getattr(params, name, unset) not in (unset, {}, "")]


def refusion_request_error(req: Any, block_size: int, slot_size: int, num_blocks: int
                        ) -> str | None:
    """Why ReFusion cannot serve ``req`` (first words: what to do), or ``None``."""
    from diffspec.core.slots import slot_layout

    params = req.sampling_params
    asked, ignored = sampling_asked(params), ignored_fields(params)
    if asked or ignored:
        todo = ([] if not asked else ["set temperature 0 (or leave the sampling fields out)"]
                ) + ([f"remove {', '.join(ignored)}"] if ignored else [])
        return (f"{' and '.join(todo)}: ReFusion in SGLang decodes greedily (its plan and "
                f"verify rules are greedy) and would ignore {', '.join(asked + ignored)}")
    logprobs = logprobs_error(req, f"--dllm-algorithm {REFUSION} commits whole slots of "
                                   f"tokens by its own rules")
    if logprobs:
        return logprobs
    if not params.max_new_tokens:  # SGLang's n > 1 first sends the prompt alone to cache it
        return ("set n to 1 and max_tokens >= 1: ReFusion in SGLang decodes a request's "
                "generation in one KV block and cannot serve a prompt-only request "
                "(max_new_tokens 0), which SGLang sends before n > 1 samples; its greedy "
                "samples would all be the same")
    gen_len, block_len = slot_layout(params.max_new_tokens, slot_size, num_blocks)
    if gen_len > block_size:
        return (f"set max_new_tokens <= {block_size} or raise block_size in "
                f"--dllm-algorithm-config: a request's generation must fit the KV block "
                f"SGLang gives it; max_new_tokens {params.max_new_tokens} rounds up to "
                f"{gen_len} (whole slots of {slot_size})")
    if block_len is None:
        return (f"set max_new_tokens to a multiple of {slot_size * num_blocks} (or change "
                f"num_blocks / slot_size): {gen_len} tokens ({params.max_new_tokens} rounded "
                f"up to whole slots of {slot_size}) do not split into {num_blocks} serial "
                f"blocks of whole slots")
    return None
