"""Engine tier: each method served by vLLM's OpenAI server as the docs start it, and called
as clients call it (issue 45).

One server per method (a module-scoped fixture; every case runs against it, then it is
stopped): ``python -m vllm.entrypoints.openai.api_server`` with diffspec's flags (the
self-speculative methods on vLLM's V1 runner; Fast-dLLM and ReFusion on its V2 runner,
through the Triton-interpreter harness :mod:`tests.engine.vllm_v2_cpu`), on a copy of the
bundled checkpoint whose generation_config.json carries Qwen3's sampling defaults
(temperature 0.6, top_p 0.95, top_k 20), as published checkpoints do: the server fills a
request's missing sampling fields from it.

Each case answers 200 with output equal to its oracle, or a 4xx whose first words say what
to do; after every case the server still runs. The oracles:

* Fast-dLLM, ReFusion (greedy): the reference decoder (:mod:`diffspec.spec_workers.reference`)
  with the server's settings, for requests that set no sampling field (diffspec's hooks
  serve them with vLLM's neutral defaults, not the file's 0.6);
* Orthrus, NLD linear self-speculation, TiDAR (lossless): plain AR decoding of the AR view
  (the reference decoder's ``ar_generate``) for greedy requests (``temperature 0``); a
  request that sets no sampling field samples at the file's temperature 0.6, so it is
  checked for a 200 and its length, and a seeded one for the same tokens on a second call.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from tests.engine.server_cases import (
    Served,
    ServerCases,
    ar_oracle,
    fast_dllm_oracle,
    refusion_oracle,
)
from tests.engine.server_clients import QWEN3_SAMPLING

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REFUSION = {"slot_size": 8, "slot_threshold": 0.0, "num_blocks": 2}
REFUSION_CANVAS = 64
FAST_DLLM_BLOCK = 8


def _methods() -> dict[str, dict]:
    from diffspec.assets import (
        SYNTH_DLLM_DIR,
        SYNTH_NLD_DIR,
        SYNTH_ORTHRUS_DIR,
        SYNTH_REFUSION_DIR,
        SYNTH_TIDAR_DIR,
    )

    def self_spec(asset: Path, config: dict) -> dict:
        return {"asset": asset, "v2": False, "lossless": True, "oracle": ar_oracle,
                "greedy": {"temperature": 0.0},
                "args": ["--speculative-config", json.dumps(config)]}

    return {
        # docs/vllm.md: the V1 runner, diffspec's default configuration (adaptive drafting)
        "orthrus": self_spec(SYNTH_ORTHRUS_DIR, {"method": "orthrus", "num_speculative_tokens": 3}),
        "linear_self_spec": self_spec(SYNTH_NLD_DIR, {"method": "linear_self_spec",
                                                      "num_speculative_tokens": 3}),
        "tidar": self_spec(SYNTH_TIDAR_DIR, {"method": "tidar"}),  # drafts: the trained branch
        # docs/vllm.md: --diffusion-config, prefix caching off for Fast-dLLM
        "fast_dllm": {"asset": SYNTH_DLLM_DIR / "llada", "v2": True, "lossless": False,
                      "greedy": {},
                      "oracle": partial(fast_dllm_oracle, block=FAST_DLLM_BLOCK,
                                        causal_prefill=True),
                      "args": ["--diffusion-config",
                               json.dumps({"canvas_length": FAST_DLLM_BLOCK}),
                               "--no-enable-prefix-caching"]},
        "refusion": {"asset": SYNTH_REFUSION_DIR, "v2": True, "lossless": False,
                     "oracle": partial(refusion_oracle, settings=REFUSION), "greedy": {},
                     "args": ["--diffusion-config",
                              json.dumps({"canvas_length": REFUSION_CANVAS}),
                              "--max-num-batched-tokens", "512", "--additional-config",
                              json.dumps({"diffspec": {"refusion": REFUSION}})]},
    }


@pytest.fixture(scope="module",
                params=["orthrus", "linear_self_spec", "tidar", "fast_dllm", "refusion"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import os

    from diffspec.serving import ServerProcess, free_port, vllm_server_command
    from tests.engine.conftest import require_engine, skip_or_fail
    from tests.engine.server_clients import with_sampling_defaults
    from tests.engine.vllm_v2_cpu import REPO, triton_interpreter_missing, vllm_v2_cpu_env

    require_engine("vllm")
    spec = _methods()[request.param]
    if spec["v2"] and (why := triton_interpreter_missing()):
        skip_or_fail("vllm", why)
    tmp = tmp_path_factory.mktemp(f"vllm_server_{request.param}")
    model = with_sampling_defaults(spec["asset"], tmp / "model", QWEN3_SAMPLING)
    port = free_port()
    cmd = vllm_server_command(model, port, "--dtype", "float32", "--max-model-len", "512",
                              "--enforce-eager", "--block-size", "32", *spec["args"])
    base = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p)}
    env = vllm_v2_cpu_env(base) if spec["v2"] else base
    with ServerProcess(cmd, port, engine="vllm", log_path=tmp / "server.log", env=env) as server:
        server.wait_ready(600)
        yield Served(request.param, str(model), server.url, server, spec["greedy"],
                     spec["oracle"](model), spec["lossless"],
                     "leave temperature out of the request")



class TestServer(ServerCases):
    """The shared cases (:mod:`tests.engine.server_cases`) against this module's server."""


@pytest.mark.parametrize("served", ["refusion"], indirect=True)
def test_refusion_chat_without_max_tokens_gets_the_canvas(served: Served) -> None:
    """A chat request with messages only: vLLM would give it what is left of max_model_len,
    which no canvas holds (400); the ReFusion hook makes the canvas its default max_tokens."""
    from tests.engine.server_cases import CHAT, _choice_tokens, _prompt_tokens

    status, body = served.call("/v1/chat/completions", {"messages": CHAT,
                                                        "return_token_ids": True})
    assert status == 200, body
    assert _choice_tokens(body) == served.oracle(_prompt_tokens(body), REFUSION_CANVAS)
