"""Engine tier: each method served by SGLang's ``launch_server`` as the docs start it
(through the CPU harness :mod:`tests.engine.sglang_cpu`), and called as clients call it
(issue 45). The cases are :mod:`tests.engine.server_cases`; one server per method (a
module-scoped fixture), on a copy of the bundled checkpoint whose generation_config.json
carries Qwen3's sampling defaults (temperature 0.6, top_p 0.95, top_k 20): SGLang's OpenAI
server fills a chat request's missing sampling fields from it (``--sampling-defaults
model``, its default).

The oracles: for FastDLLM and ReFusion (greedy) the reference decoder with the server's
settings, for requests that set no sampling field (diffspec's launch check has SGLang fill
their gaps with its own defaults, which the greedy algorithms serve); for ORTHRUS
(lossless; LINEAR_SELF_SPEC, TIDAR too) plain AR decoding of the AR view for greedy
requests.
"""

from __future__ import annotations

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

FAST_DLLM_BLOCK = 8
REFUSION = {"slot_size": 8, "slot_threshold": 0.0, "num_blocks": 2, "block_size": 64}
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
            "pytorch", "--disable-cuda-graph", "--dtype", "float32", "--mem-fraction-static",
            "0.3", "--max-total-tokens", "8192")


def _yaml(path: Path, options: dict) -> str:
    path.write_text("".join(f"{k}: {v}\n" for k, v in options.items()))
    return str(path)


def _methods(tmp: Path) -> dict[str, dict]:
    from diffspec.assets import (
        SYNTH_DLLM_DIR,
        SYNTH_NLD_DIR,
        SYNTH_ORTHRUS_DIR,
        SYNTH_REFUSION_DIR,
        SYNTH_TIDAR_DIR,
    )

    def self_spec(asset: Path, *args: str) -> dict:
        return {"asset": asset, "lossless": True, "oracle": ar_oracle,
                "greedy": {"temperature": 0.0}, "refusal": "",
                "args": ["--speculative-algorithm", *args]}

    return {
        # docs/sglang.md's commands
        "orthrus": self_spec(SYNTH_ORTHRUS_DIR, "ORTHRUS", "--speculative-num-draft-tokens", "4"),
        "linear_self_spec": self_spec(SYNTH_NLD_DIR, "LINEAR_SELF_SPEC",
                                      "--speculative-num-draft-tokens", "16"),
        "tidar": self_spec(SYNTH_TIDAR_DIR, "TIDAR"),  # anchor + one trained branch
        "fast_dllm": {"asset": SYNTH_DLLM_DIR / "llada", "lossless": False,
                      "greedy": {},
                      "oracle": partial(fast_dllm_oracle, block=FAST_DLLM_BLOCK,
                                        causal_prefill=False),
                      "refusal": "set temperature 0 (or top_k 1) for --dllm-algorithm FastDLLM",
                      "args": ["--dllm-algorithm", "FastDLLM", "--dllm-algorithm-config",
                               _yaml(tmp / "fast_dllm.yaml", {"block_size": FAST_DLLM_BLOCK})]},
        "refusion": {"asset": SYNTH_REFUSION_DIR, "lossless": False,
                     "oracle": partial(refusion_oracle, settings=REFUSION), "greedy": {},
                     "refusal": "set temperature 0 (or leave the sampling fields out)",
                     "args": ["--dllm-algorithm", "ReFusion", "--dllm-algorithm-config",
                              _yaml(tmp / "refusion.yaml", REFUSION)]},
    }


@pytest.fixture(scope="module",
                params=["fast_dllm", "refusion", "orthrus", "linear_self_spec", "tidar"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    import os

    from diffspec.serving import ServerProcess, free_port, sglang_server_command
    from tests.engine.conftest import require_sglang
    from tests.engine.server_clients import with_sampling_defaults
    from tests.engine.sglang_cpu import sglang_cpu_env
    from tests.engine.vllm_v2_cpu import REPO

    python = require_sglang()
    tmp = tmp_path_factory.mktemp(f"sglang_server_{request.param}")
    spec = _methods(tmp)[request.param]
    model = with_sampling_defaults(spec["asset"], tmp / "model", QWEN3_SAMPLING)
    port = free_port()
    cmd = sglang_server_command(model, port, *CPU_ARGS, *spec["args"], python=python)
    env = dict(sglang_cpu_env(python))
    # the server imports this checkout's diffspec (its plugin entry point is the editable
    # install's; this checkout first on the path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    with ServerProcess(cmd, port, engine="sglang", log_path=tmp / "server.log",
                       env=env) as server:
        server.wait_ready(600)
        # SGLang applies a request's seed only under --enable-deterministic-inference
        # (sampling_batch_info), which refuses torch_native: a sampled seeded request's
        # tokens vary run to run here, plain AR's too (measured: 3 outputs in 6 calls)
        yield Served(request.param, str(model), server.url, server, spec["greedy"],
                     spec["oracle"](model), spec["lossless"], spec["refusal"],
                     seeds_apply=not spec["lossless"])



class TestServer(ServerCases):
    """The shared cases (:mod:`tests.engine.server_cases`) against this module's server."""


def test_launch_says_once_what_the_dllm_algorithms_serve(served: Served) -> None:
    """The dLLM launch logs, once, that a request's missing sampling fields get SGLang's
    defaults, not generation_config.json's (a line only this checkout's plugin writes); a
    self-speculative launch keeps the model's defaults (it samples as AR does)."""
    log = served.server.log_path.read_text(errors="replace")
    assert log.count("--sampling-defaults openai") == (0 if served.lossless else 1), log[-3000:]


@pytest.mark.parametrize("served", ["refusion"], indirect=True)
def test_refusion_chat_without_max_tokens_gets_the_block(served: Served) -> None:
    """A chat request with messages only: SGLang would give it what is left of the context,
    which no KV block holds; ReFusion makes its block (the most tokens a request may
    generate) the default max_new_tokens, decoded as the reference decodes it."""
    from tests.engine.server_cases import CHAT, _choice_tokens, _prompt_tokens

    status, body = served.call("/v1/chat/completions", {"messages": CHAT,
                                                        "return_token_ids": True})
    assert status == 200, body
    assert _choice_tokens(body) == served.oracle(_prompt_tokens(body), REFUSION["block_size"])
