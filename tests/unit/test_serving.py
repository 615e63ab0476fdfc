"""diffspec.serving: the server process helper (against a stand-in HTTP server on
loopback) and the counter parsers (Prometheus pages in vLLM's exposition, vLLM's offline
metrics, SGLang's meta_info)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffspec.serving import (
    ServerError,
    ServerProcess,
    SpecDecodeCounters,
    free_port,
    metric_totals,
    port_is_free,
    sglang_server_command,
    spec_decode_counters,
    spec_decode_counters_from_sglang,
    spec_decode_counters_from_vllm,
    vllm_server_command,
)

# What vLLM's /metrics page looks like (prometheus_client exposition: TYPE lines, _created
# samples, one label set per engine / model; per-position counters with a position label).
VLLM_PAGE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 84.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 18.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
"""


def test_spec_decode_counters_from_a_vllm_page() -> None:
    c = spec_decode_counters(VLLM_PAGE)
    assert c == SpecDecodeCounters(drafts=12.0, draft_tokens=84.0, accepted=30.0,
                                   accepted_per_pos=(18.0, 12.0))
    assert c.acceptance_length == 1 + 30 / 12
    totals = metric_totals(VLLM_PAGE)
    assert totals["vllm:spec_decode_num_drafts_total"] == 12.0
    assert totals["vllm:prefix_cache_hits_total"] == 96.0
    # a page without the counters (a server that does not speculate) reads zeros
    empty = spec_decode_counters("# HELP x y\n# TYPE x counter\nx_total 3.0\n")
    assert empty == SpecDecodeCounters() and empty.acceptance_length is None


def test_counter_differences() -> None:
    before = SpecDecodeCounters(2, 14, 5, (3.0, 2.0))
    after = SpecDecodeCounters(5, 35, 11, (6.0, 4.0, 1.0))
    assert after - before == SpecDecodeCounters(3, 21, 6, (3.0, 2.0, 1.0))
    assert (after - before).acceptance_length == 3.0


def test_counters_from_vllm_offline_metrics_and_sglang_meta() -> None:
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=4),
               SimpleNamespace(name="vllm:spec_decode_num_drafts", value=1),  # second engine
               SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=35),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=9),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                               values=[4, 3, 2]),
               SimpleNamespace(name="vllm:prefix_cache_hits", value=7)]
    assert spec_decode_counters_from_vllm(metrics) == SpecDecodeCounters(5, 35, 9,
                                                                          (4.0, 3.0, 2.0))
    # SGLang: bin n of the histogram = steps that accepted n drafts
    meta = {"spec_verify_ct": 4, "spec_num_proposed_drafts": 124, "spec_num_correct_drafts": 5,
            "spec_correct_drafts_histogram": [1, 2, 0, 1]}
    assert spec_decode_counters_from_sglang(meta) == SpecDecodeCounters(4, 124, 5,
                                                                         (3.0, 1.0, 1.0))
    assert spec_decode_counters_from_sglang({}) == SpecDecodeCounters()


def test_server_commands() -> None:
    cmd = sglang_server_command("/m", 1234, "--dtype", "float32", python="/py")
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", "/m", "--host",
                   "127.0.0.1", "--port", "1234", "--dtype", "float32"]
    cmd = vllm_server_command(Path("/m"), 1234, "--enforce-eager", python="/other/python")
    assert cmd == ["/other/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
                   "--host", "127.0.0.1", "--port", "1234", "--enforce-eager"]


# A stand-in server: ready after READY_AFTER seconds, serves /metrics, and leaves a child
# process in its group (as vLLM's engine core is) that must die with it.
_FAKE_SERVER = """
import http.server, json, subprocess, sys, time
port, ready_after, pid_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(pid_file, "w").write(str(child.pid))
start = time.monotonic()
print("fake server starting", flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body):
        self.send_response(code); self.end_headers(); self.wfile.write(body.encode())
    def do_GET(self):
        if self.path == "/health":
            self._send(200 if time.monotonic() - start > ready_after else 503, "")
        elif self.path == "/metrics":
            self._send(200, 'vllm:spec_decode_num_drafts_total{engine="0"} 3\\n')
        else:
            self._send(404, "")
    def do_POST(self):
        n = int(self.headers["Content-Length"])
        self._send(200, json.dumps({"echo": json.loads(self.rfile.read(n))}))

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_server_process_ready_requests_and_stop(tmp_path: Path) -> None:
    port = free_port()
    pid_file = tmp_path / "child.pid"
    cmd = [sys.executable, "-c", _FAKE_SERVER, str(port), "1.0", str(pid_file)]
    with ServerProcess(cmd, port, log_path=tmp_path / "log") as server:
        server.wait_ready(60, poll_s=0.2)
        assert server.json("/generate", {"a": 1}) == {"echo": {"a": 1}}
        assert server.spec_decode_counters().drafts == 3
        child = int(pid_file.read_text())
        assert _alive(child)
    assert server.proc.poll() is not None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the server's child outlived stop()"
    assert "fake server starting" in (tmp_path / "log").read_text()
    assert port_is_free(port)
    server.stop()  # idempotent


def test_server_process_errors_carry_the_log_tail(tmp_path: Path) -> None:
    port = free_port()
    crash = [sys.executable, "-c",
             "print('loading model'); print('boom: bad config'); raise SystemExit(3)"]
    with pytest.raises(ServerError, match=r"(?s)exited with code 3.*boom: bad config"):
        ServerProcess(crash, port, log_path=tmp_path / "crash.log").wait_ready(60, poll_s=0.1)
    never = [sys.executable, "-c", _FAKE_SERVER, str(port), "1e9", str(tmp_path / "pid")]
    server = ServerProcess(never, port, log_path=tmp_path / "slow.log")
    with pytest.raises(ServerError, match=r"(?s)not ready after 2 s.*fake server starting"):
        server.wait_ready(2, poll_s=0.2)
    assert server.proc.poll() is not None  # stopped on the way out
    with pytest.raises(ValueError, match="engine must be one of"):
        ServerProcess(never, port, engine="tgi")


def test_an_interrupted_stop_still_kills_the_server(tmp_path: Path) -> None:
    """Ctrl-C (or quickstart's SIGTERM handler) while stop() waits for a server that takes
    its time: the SIGKILL still goes out, nothing is left running."""
    import _thread
    import threading

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(600)")
    server = ServerProcess([sys.executable, "-c", stubborn], free_port(),
                           log_path=tmp_path / "log")
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    # Python's own SIGINT handler for the test: an earlier test in the same process (an
    # engine started in-process) may have installed another, and interrupt_main raises
    # KeyboardInterrupt only through the default one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            server.stop(timeout_s=30)
        assert time.monotonic() - start < 10
        assert server.proc.poll() is not None
    finally:
        signal.signal(signal.SIGINT, previous)
        if server.proc.poll() is None:  # the test failed: do not leave it running
            server.proc.kill()
            server.proc.wait()
