"""The cases of the server suites (``test_vllm_servers.py``, ``test_sglang_servers.py``):
requests as clients send them, against one running server (:class:`Served`, the suites'
module-scoped ``served`` fixture), each answered 200 with output equal to its oracle or a
4xx whose first words say what to do; after each, the server still serves. Each suite
subclasses :class:`ServerCases`, so pytest collects them there with that suite's fixture."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.engine.server_clients import abort_stream, post, stream

__all__ = ["CHAT", "MAX_TOKENS", "PROMPTS", "Served", "ServerCases", "ar_oracle",
           "fast_dllm_oracle", "refusion_oracle"]

PROMPTS = ("losal putol lubam zeka genis robem", "pagi ronil reken fofen", "zeka lubam",
           "robem puren pagi ronil losal")
CHAT = [{"role": "user", "content": "losal putol lubam zeka"}]
MAX_TOKENS = 16  # ReFusion's slots x blocks divide it; two Fast-dLLM blocks of 8
ABORTED_MAX_TOKENS = 64


@dataclass
class Served:
    method: str
    model: str  # the checkpoint copy (the OpenAI "model" name)
    url: str
    server: Any  # diffspec.serving.ServerProcess
    greedy: dict  # what makes a request greedy here ({} for the dLLMs: no sampling field)
    oracle: Callable[[list[int], int], list[int]]  # greedy tokens: (prompt ids, max_tokens)
    lossless: bool
    refusal: str  # the first words of the 400 that refuses temperature 0.6 (dLLMs)
    # the engine applies a sampled request's seed (SGLang: only with
    # --enable-deterministic-inference, which refuses the CPU path's torch_native backend)
    seeds_apply: bool = True

    def call(self, path: str, body: dict) -> tuple[int, Any]:
        return post(self.url + path, {"model": self.model, **body})

    def alive(self) -> None:
        assert self.server.proc.poll() is None, self.server.log_tail()
        status, body = post(self.url + "/v1/completions",
                            {"model": self.model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                             **self.greedy})
        assert status == 200, body


Oracle = Callable[[list[int], int], list[int]]  # greedy tokens for (prompt ids, max_tokens)


def ar_oracle(path: Path) -> Oracle:
    """Plain AR decoding of the checkpoint's AR view (greedy), stopping on its EOS ids."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, ar_generate, load_ar_view

    info = inspect_checkpoint(path)
    model = load_ar_view(info)

    def oracle(prompt: list[int], max_tokens: int) -> list[int]:
        return ar_generate(model, [Request(prompt, max_tokens,
                                           stop_token_ids=info.eos_token_ids)])[0].token_ids
    return oracle


def fast_dllm_oracle(path: Path, block: int, causal_prefill: bool) -> Oracle:
    """The reference Fast-dLLM decoder (prefix cache, the registry's threshold, blocks of
    ``block``, block-causal as both engines run LLaDA / Dream; ``causal_prefill``: the
    prompt prefilled causally, as vLLM's diffusion path does, else in blocks aligned at
    position 0, as SGLang's dLLM mode does), stopping on the EOS ids and the turn end."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.methods import get_method
    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.fast_dllm import (
        FastDLLMConfig,
        fast_dllm_generate,
        turn_end_token_ids,
    )

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    stops = tuple(dict.fromkeys([*inspect_checkpoint(path).eos_token_ids,
                                 *turn_end_token_ids(tokenizer)]))
    threshold = get_method("fast_dllm").defaults["threshold"]
    if causal_prefill:
        lm = replace(load_dllm(path), attention="block_causal", causal_prefix=True)
        config = FastDLLMConfig(cache="prefix", block_size=block, sub_block_size=block,
                                threshold=threshold)
    else:
        lm = load_dllm(path)
        config = FastDLLMConfig(cache="prefix", block_size=block, threshold=threshold,
                                attention="block_causal")

    def oracle(prompt: list[int], max_tokens: int) -> list[int]:
        return fast_dllm_generate(lm, [Request(prompt, max_tokens, stop_token_ids=stops)],
                                  config)[0].token_ids
    return oracle


def refusion_oracle(path: Path, settings: dict) -> Oracle:
    """The reference ReFusion decoder with ``settings`` (slot_size, thresholds,
    num_blocks; registry defaults for the rest), stopping on the EOS ids."""
    from diffspec.methods import get_method
    from diffspec.model_executors.reference.refusion import load_refusion
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate

    model, info = load_refusion(path)
    defaults = get_method("refusion").defaults
    config = ReFusionConfig(**{k: settings.get(k, v) for k, v in defaults.items()})

    def oracle(prompt: list[int], max_tokens: int) -> list[int]:
        return refusion_generate(model, [Request(prompt, max_tokens,
                                                 stop_token_ids=info.eos_token_ids)],
                                 config, int(info.mask_token_id))[0].token_ids
    return oracle


def _choice_tokens(body: dict) -> list[int]:
    """The generated token ids of a ``return_token_ids`` answer (SGLang's chat answer names
    them ``response_token_ids``)."""
    choice = body["choices"][0]
    return choice["token_ids"] if "token_ids" in choice else choice["response_token_ids"]


def _prompt_tokens(body: dict) -> list[int]:
    """The prompt's token ids of a ``return_token_ids`` answer (vLLM: top level for chat,
    in the choice for completions; SGLang: in the choice)."""
    ids = body.get("prompt_token_ids") or body["choices"][0].get("prompt_token_ids")
    assert ids, body
    return ids


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error.get("message", "")
    return body.get("message", "") if isinstance(body, dict) else str(body)


class ServerCases:
    """The cases, as methods of a class each suite subclasses (``class TestServer``), so
    pytest collects them there with that suite's module-scoped ``served`` fixture."""

    def test_completion_with_no_sampling_fields(self, served: Served) -> None:
        """``{"model", "prompt"}`` and nothing else (max_tokens: the API's default 16)."""
        status, body = served.call("/v1/completions", {"prompt": PROMPTS[0],
                                                       "return_token_ids": True})
        assert status == 200, body
        choice = body["choices"][0]
        assert 0 < len(choice["token_ids"]) <= 16
        if not served.lossless:  # served greedily, whatever generation_config.json says
            assert choice["token_ids"] == served.oracle(_prompt_tokens(body), 16)
        served.alive()

    def test_chat_with_no_sampling_fields(self, served: Served) -> None:
        status, body = served.call("/v1/chat/completions", {"messages": CHAT,
                                                            "max_tokens": MAX_TOKENS,
                                                            "return_token_ids": True})
        assert status == 200, body
        tokens = _choice_tokens(body)
        assert 0 < len(tokens) <= MAX_TOKENS
        if not served.lossless:
            assert tokens == served.oracle(_prompt_tokens(body), MAX_TOKENS)
        served.alive()

    def test_chat_with_messages_only(self, served: Served) -> None:
        """``{"model", "messages"}``: the OpenAI SDK's chat call with nothing else (no
        max_tokens: the engine's default length, ReFusion's canvas); answered, not refused."""
        status, body = served.call("/v1/chat/completions", {"messages": CHAT,
                                                            "return_token_ids": True})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
        assert _choice_tokens(body), body
        served.alive()

    @pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": True, "top_logprobs": 2},
                                       {"stop": ["zeka", "pagi"]}, {"stream": True, "n": 2},
                                       {"presence_penalty": 0.5}, {"logit_bias": {"5": 2}}],
                             ids=["n", "logprobs", "stop", "stream-n", "penalty", "logit-bias"])
    def test_other_client_options_are_answered_or_refused(self, served: Served,
                                                          extra: dict) -> None:
        """Chat options clients send besides the defaults: each is served (200) or refused
        with a 4xx that says what to do; never a 500, a hang or a dead engine."""
        body = {"messages": CHAT, "max_tokens": MAX_TOKENS, **extra}
        if extra.get("stream"):
            status, events = stream(served.url + "/v1/chat/completions",
                                    {"model": served.model, **body})
            errors = [e["error"] for e in events if "error" in e]
            assert status == 200 or 400 <= status < 500, (status, events)
            # an error inside a 200 stream: a 4xx's, with its message
            assert all(isinstance(e, str) or 400 <= int(e.get("code") or 400) < 500
                       for e in errors), events
            if status == 200 and not errors:
                finished = {c["index"] for e in events for c in e.get("choices", ())
                            if c.get("finish_reason") in ("stop", "length")}
                assert finished == set(range(extra.get("n", 1))), events
        else:
            status, answer = served.call("/v1/chat/completions", body)
            assert status == 200 or 400 <= status < 500, (status, answer)
            if status == 200:
                assert len(answer["choices"]) == extra.get("n", 1), answer
                assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
            else:
                assert _message(answer), answer
            print(f"{extra}: {status}", "" if status == 200 else _message(answer))  # -rA
            if not served.lossless and {"presence_penalty", "logit_bias", "logprobs"} & set(extra):
                assert status == 400, answer  # the dLLMs would ignore them: refused
        served.alive()

    def test_greedy_completion_equals_oracle(self, served: Served) -> None:
        status, body = served.call("/v1/completions", {"prompt": PROMPTS[1],
                                                       "max_tokens": MAX_TOKENS,
                                                       "return_token_ids": True, **served.greedy})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == served.oracle(_prompt_tokens(body), MAX_TOKENS)

    def test_streaming_equals_oracle(self, served: Served) -> None:
        request = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "return_token_ids": True,
                   **served.greedy}
        status, events = stream(served.url + "/v1/completions", {"model": served.model, **request})
        assert status == 200, events
        streamed = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
        text = "".join(c["text"] for e in events for c in e["choices"])
        status, body = served.call("/v1/completions", request)
        assert status == 200, body
        assert streamed == _choice_tokens(body)
        assert text == body["choices"][0]["text"]
        assert streamed == served.oracle(_prompt_tokens(body), MAX_TOKENS)

    def test_openai_sdk_defaults(self, served: Served) -> None:
        """The ``openai`` package's calls with nothing but model, prompt / messages and
        max_tokens: whatever the SDK sends by default is served."""
        import openai  # a dependency of vLLM (and of SGLang): present wherever the engines are
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        completion = client.completions.create(model=served.model, prompt=PROMPTS[3],
                                               max_tokens=MAX_TOKENS)
        chat = client.chat.completions.create(model=served.model, messages=CHAT,
                                              max_tokens=MAX_TOKENS)
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert chat.choices[0].finish_reason in ("length", "stop")
        if not served.lossless:  # greedy: the same text as the same request sent by hand
            _, body = served.call("/v1/completions", {"prompt": PROMPTS[3],
                                                      "max_tokens": MAX_TOKENS})
            assert completion.choices[0].text == body["choices"][0]["text"]
            _, body = served.call("/v1/chat/completions", {"messages": CHAT,
                                                           "max_tokens": MAX_TOKENS})
            assert chat.choices[0].message.content == body["choices"][0]["message"]["content"]
        served.alive()

    def test_two_turn_chat_equals_oracle(self, served: Served) -> None:
        messages = list(CHAT)
        for turn in ("reken fofen pagi", "zeka zeka robem"):
            status, body = served.call("/v1/chat/completions", {
                "messages": messages, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                **served.greedy})
            assert status == 200, body
            assert _choice_tokens(body) == served.oracle(_prompt_tokens(body), MAX_TOKENS)
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": turn}]

    def test_seeded_request_twice_gives_the_same_tokens(self, served: Served) -> None:
        """A seeded sampled request (lossless methods: sampled; the dLLMs serve the seed and
        decode greedily) gives the same tokens on two identical calls, where the engine applies
        a request's seed (:attr:`Served.seeds_apply`)."""
        request = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "return_token_ids": True,
                   "seed": 1234}
        if served.lossless:
            request.update(temperature=0.8, top_p=0.95)
        first, second = (served.call("/v1/completions", request) for _ in range(2))
        assert first[0] == second[0] == 200, (first, second)
        assert all(0 < len(_choice_tokens(r[1])) <= MAX_TOKENS for r in (first, second))
        if served.seeds_apply:  # else plain AR's seeded tokens vary too (measured: SGLang CPU)
            assert _choice_tokens(first[1]) == _choice_tokens(second[1])
        if not served.lossless:
            assert _choice_tokens(first[1]) == served.oracle(
                _prompt_tokens(first[1]), MAX_TOKENS)

    def test_concurrent_clients_equal_oracle(self, served: Served) -> None:
        results: dict[int, tuple[int, Any]] = {}

        def client(i: int) -> None:
            results[i] = served.call("/v1/completions", {
                "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "return_token_ids": True,
                **served.greedy})

        threads = [threading.Thread(target=partial(client, i)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert sorted(results) == list(range(len(PROMPTS)))
        for status, body in results.values():
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["token_ids"] == served.oracle(_prompt_tokens(body), MAX_TOKENS)

    def test_aborted_stream_then_the_next_request_is_served(self, served: Served) -> None:
        assert abort_stream(served.url + "/v1/completions", {
            "model": served.model, "prompt": PROMPTS[1], "max_tokens": ABORTED_MAX_TOKENS,
            **served.greedy}) >= 1
        self.test_greedy_completion_equals_oracle(served)
        served.alive()

    def test_sampling_the_method_cannot_honour_is_refused(self, served: Served) -> None:
        """The dLLMs decode greedily: an explicit temperature 0.6 is refused with what to do;
        temperature 0 is served. A lossless method samples it (200)."""
        status, body = served.call("/v1/chat/completions", {"messages": CHAT, "temperature": 0.6,
                                                            "max_tokens": MAX_TOKENS})
        if served.lossless:
            assert status == 200, body
        else:
            assert status == 400, body
            assert _message(body).startswith(served.refusal), body
            status, body = served.call("/v1/chat/completions", {
                "messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS,
                "return_token_ids": True})
            assert status == 200, body
            assert _choice_tokens(body) == served.oracle(_prompt_tokens(body), MAX_TOKENS)
        served.alive()
