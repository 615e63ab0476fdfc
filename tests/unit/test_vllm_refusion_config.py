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
