"""The engine-free parts of ReFusion in SGLang: its ``--dllm-algorithm-config`` settings
(:func:`diffspec.plugin.sglang.refusion.refusion_options`) and the per-request refusal
(:func:`diffspec.spec_workers.sglang.requests.refusion_request_error`). The engine itself is
checked in tests/engine/test_sglang_refusion.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffspec.core.checkpoint import CheckpointError
from diffspec.methods import get_method
from diffspec.plugin.sglang.refusion import DEFAULT_BLOCK_SIZE, refusion_options
from diffspec.spec_workers.sglang.requests import refusion_request_error


def test_defaults_are_the_registry_s() -> None:
    defaults = get_method("refusion").defaults
    assert refusion_options({}) == {**defaults, "block_size": DEFAULT_BLOCK_SIZE}
    assert DEFAULT_BLOCK_SIZE % defaults["slot_size"] == 0


def test_settings_are_read() -> None:
    got = refusion_options({"slot_size": 8, "slot_threshold": 0.5, "token_threshold": 0,
                            "num_blocks": 4, "block_size": 64})
    assert got == {"slot_size": 8, "slot_threshold": 0.5, "token_threshold": 0.0,
                   "num_blocks": 4, "block_size": 64}


@pytest.mark.parametrize(("options", "first_words"), [
    ({"steps": 4}, "remove steps from"),
    ({"slot_size": 0}, "fix cfg.yaml: slot_size must be"),
    ({"slot_threshold": 1.5}, "fix cfg.yaml: slot_threshold must be"),
    ({"token_threshold": "high"}, "fix cfg.yaml: token_threshold must be"),
    ({"num_blocks": 0}, "fix cfg.yaml: num_blocks must be"),
    ({"block_size": 48}, "set block_size in cfg.yaml to a multiple of slot_size 32"),
    ({"slot_size": 8, "block_size": 4}, "set block_size"),
    ({"block_size": True}, "set block_size"),
    ({"slot_size": 8, "num_blocks": 4, "block_size": 24},
     "raise block_size in cfg.yaml to at least slot_size x num_blocks = 32"),
])
def test_bad_settings_say_what_to_do(options: dict, first_words: str) -> None:
    with pytest.raises(CheckpointError) as info:
        refusion_options(options, "cfg.yaml")
    assert str(info.value).startswith(first_words), str(info.value)


def _req(max_new_tokens: int, temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
         **fields: object):
    """SGLang stores greedy requests as temperature 1 with top_k 1, and a request that
    sets no sampling field as temperature 1 with top_k ``1 << 30`` (the whole vocabulary)."""
    return SimpleNamespace(sampling_params=SimpleNamespace(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=0.0, **fields))


@pytest.mark.parametrize(("req", "num_blocks", "first_words"), [
    (_req(64), 1, None),  # greedy, rounds up to 64 = the block
    (_req(57), 1, None),
    (_req(57), 4, None),  # 64 = 4 serial blocks of 2 slots
    (_req(65), 1, "set max_new_tokens <= 64"),  # rounds up to 72 > 64
    (_req(40), 2, "set max_new_tokens to a multiple of 16"),  # 2 blocks of 2.5 slots
    (_req(20, temperature=0.7, top_k=1 << 30), 1, "set temperature 0"),
    (_req(20, top_k=1 << 30), 1, None),  # no sampling field set: served greedily
    (_req(20, top_k=1 << 30, top_p=0.9), 1, "set temperature 0"),
    (_req(0), 1, "set n to 1 and max_tokens >= 1"),  # SGLang's prompt-only request for n > 1
    (_req(16, presence_penalty=0.5), 1, "remove presence_penalty: ReFusion"),  # ignored
    (_req(16, temperature=0.7, top_k=1 << 30, logit_bias={5: 2.0}), 1,
     "set temperature 0 (or leave the sampling fields out) and remove logit_bias"),
    (SimpleNamespace(return_logprob=True, sampling_params=_req(16).sampling_params), 1,
     "leave logprobs out of the request"),
])
def test_requests_refused_with_what_to_do(req, num_blocks: int, first_words: str | None
                                          ) -> None:
    message = refusion_request_error(req, 64, 8, num_blocks)
    if first_words is None:
        assert message is None
    else:
        assert message is not None and message.startswith(first_words), message


@pytest.mark.parametrize(("options", "refused"), [
    ({}, False),  # the registry defaults: slots of 32, one block
    ({"slot_size": 8, "num_blocks": 2, "block_size": 64}, True),  # 8 tokens: one slot
    ({"num_blocks": 4}, True),  # the model card's GSM8K setting
    ({"slot_size": 4, "num_blocks": 2, "block_size": 64}, False),
])
def test_warmup_it_would_refuse_is_known_at_launch(options: dict, refused: bool) -> None:
    """SGLang's start-up warm-up asks for 8 tokens; settings that refuse them are found at
    launch (the launch check then skips the warm-up instead of stopping the server)."""
    from diffspec.plugin.sglang.refusion import warmup_refusal

    why = warmup_refusal(refusion_options(options, "cfg.yaml"))
    assert (why is not None) == refused, why
    if refused:
        assert why.startswith("set max_new_tokens to a multiple of"), why
