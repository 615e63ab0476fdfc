"""The engine-free parts of ReFusion in vLLM: its settings
(:func:`diffspec.plugin.vllm.refusion.refusion_settings`) and the per-request check the
``refusion_requests`` patch raises (:func:`~diffspec.plugin.vllm.refusion.refusion_request_error`).
The engine itself is checked in tests/engine/test_vllm_refusion.py."""

from __future__ import annotations

import pytest

from diffspec.core.checkpoint import CheckpointError
from diffspec.methods import get_method
from diffspec.plugin.vllm.refusion import (
    DEFAULT_CANVAS,
    refusion_backend_error,
    refusion_request_error,
    refusion_settings,
)


def _extra(**options: object) -> dict:
    return {"diffspec": {"refusion": options}}


def test_defaults_are_the_registry_s() -> None:
    assert refusion_settings(None, None) == {**get_method("refusion").defaults,
                                             "canvas_length": DEFAULT_CANVAS}
    got = refusion_settings(_extra(slot_size=8, num_blocks=2, token_threshold=0), 64)
    assert (got["slot_size"], got["num_blocks"], got["token_threshold"],
            got["canvas_length"]) == (8, 2, 0.0, 64)


@pytest.mark.parametrize(("extra", "canvas", "first_words"), [
    (_extra(steps=4), None, "remove steps from diffspec.refusion"),
    (_extra(slot_threshold=1.5), None, "fix diffspec.refusion"),
    (_extra(num_blocks=0), None, "fix diffspec.refusion"),
    ({"diffspec": {"refusion": [1]}}, None, "make diffspec.refusion a JSON object"),
    (_extra(), 48, "set --diffusion-config's canvas_length to a multiple of slot_size 32"),
    (_extra(slot_size=8), 4, "set --diffusion-config's canvas_length"),
    (_extra(slot_size=8, num_blocks=4), 24, "raise --diffusion-config's canvas_length to at "
                                            "least slot_size x num_blocks = 32"),
])
def test_bad_settings_say_what_to_do(extra: dict, canvas: int | None, first_words: str) -> None:
    with pytest.raises(CheckpointError) as err:
        refusion_settings(extra, canvas)
    assert str(err.value).startswith(first_words), str(err.value)


SETTINGS = {"slot_size": 8, "num_blocks": 2, "canvas_length": 64}


@pytest.mark.parametrize(("prompt_len", "max_tokens", "width", "first_words"), [
    (5, 64, None, None),
    (5, 57, None, None),  # 64 generated positions (mid-slot), 2 blocks of 4 slots
    (448, 64, None, None),  # exactly max_model_len
    (5, 65, None, "set max_tokens <= 64"),
    (5, 40, None, "set max_tokens to a multiple of 16"),
    (449, 64, None, "shorten the prompt or lower max_tokens"),
    (5, 40, 32, "set max_tokens <= 32"),  # the request's own canvas width
])
def test_request_checks(prompt_len: int, max_tokens: int, width: int | None,
                        first_words: str | None) -> None:
    error = refusion_request_error(prompt_len, max_tokens, SETTINGS, 512, width)
    if first_words is None:
        assert error is None
    else:
        assert error is not None and error.startswith(first_words), error


def test_backends() -> None:
    for ok in (None, "auto", "CPU_ATTN", "TRITON_ATTN"):
        assert refusion_backend_error(ok) is None
    assert refusion_backend_error("FLASHINFER").startswith("use --attention-backend TRITON_ATTN")


def _sampling(**fields: object):
    """vLLM's ``SamplingParams`` as the front end holds them (temperature 0 resets top_p,
    top_k and min_p, as vLLM does)."""
    from types import SimpleNamespace

    base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "min_tokens": 0, "logit_bias": None, "bad_words": None, "allowed_token_ids": None,
            "seed": None, "logprobs": None, "prompt_logprobs": None}
    return SimpleNamespace(**{**base, **fields})


DIFFUSION_SAMPLING_CASES = {
    "no_sampling_fields": (_sampling(), None),  # vLLM's neutral defaults: served
    "greedy": (_sampling(temperature=0.0), None),
    "seeded": (_sampling(seed=7), None),  # greedy output is the same every time
    "generation_config_defaults": (_sampling(temperature=0.6, top_k=20, top_p=0.95),
                                   "leave temperature, top_p, top_k out of the request"),
    "penalty": (_sampling(repetition_penalty=1.1), "leave repetition_penalty out"),
    "logit_bias": (_sampling(logit_bias={3: 1.0}), "leave logit_bias out"),
    "logprobs": (_sampling(logprobs=2), "leave logprobs out of the request: ReFusion"),
    "prompt_logprobs": (_sampling(temperature=0.0, logprobs=0, prompt_logprobs=1),
                        "leave logprobs and prompt_logprobs out"),
}


@pytest.mark.parametrize("case", list(DIFFUSION_SAMPLING_CASES))
def test_diffusion_sampling_is_served_or_refused_with_what_to_do(case: str) -> None:
    """Fast-dLLM and ReFusion on vLLM decode greedily: a request with no sampling field,
    temperature 0 or a seed is served; any value they would ignore is refused, first words
    what to do (the ``refusion_requests`` patch raises it as HTTP 400)."""
    from diffspec.plugin.vllm.dllm import diffusion_request_error

    params, first_words = DIFFUSION_SAMPLING_CASES[case]
    message = diffusion_request_error(params, "ReFusion")
    if first_words is None:
        assert message is None
    else:
        assert message is not None and message.startswith(first_words), message
        assert "ReFusion on vLLM's diffusion path" in message


@pytest.mark.parametrize(("generation_config", "want"), [
    ("auto", "vllm"),  # vLLM's default: generation_config.json's sampling defaults dropped
    ("vllm", "vllm"),
    ("/my/generation/config", "/my/generation/config"),  # the user's own folder is kept
])
def test_diffusion_paths_use_neutral_sampling_defaults(generation_config: str, want: str,
                                                       caplog) -> None:
    """A request that sets no sampling field must not get generation_config.json's
    temperature 0.6 (refused by vLLM's diffusion path): the hooks switch vLLM's default
    ``--generation-config auto`` to ``vllm`` and log once what they drop."""
    from types import SimpleNamespace

    from diffspec.plugin.vllm.dllm import neutral_sampling_defaults

    model_config = SimpleNamespace(
        generation_config=generation_config,
        try_get_generation_config=lambda: {"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2})
    with caplog.at_level("INFO", logger="vllm.diffspec"):
        neutral_sampling_defaults(model_config, "ReFusion")
    assert model_config.generation_config == want
    logged = [r.getMessage() for r in caplog.records if "decodes greedily" in r.getMessage()]
    assert len(logged) == (generation_config == "auto")
    if logged:
        assert "not generation_config.json's {'temperature': 0.6, 'top_p': 0.95}" in logged[0]
