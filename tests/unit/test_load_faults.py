"""benchmarks/load_faults.py without an engine: the request schedule, the streaming client
(against a stdlib fake of ``/v1/completions``: token ids streamed in chunks, a 400 for a
prompt over the context, a stream the client closes mid-way) and the comparison."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from benchmarks.load_faults import LoadRequest, Outcome, build_requests, compare, fire

CONTEXT = 64


class _Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    closed_early: ClassVar[list[int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, n = body["prompt"], body["max_tokens"]
        if len(prompt) > CONTEXT:
            data = json.dumps({"object": "error", "message": "too long"}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = [(sum(prompt) + i) % 100 for i in range(n)]
        try:
            for start in range(0, n, 3):
                last = start + 3 >= n
                chunk = {"choices": [{"index": 0, "token_ids": tokens[start:start + 3],
                                      "finish_reason": "length" if last else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                if not last:
                    threading.Event().wait(0.01)
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            _Fake.closed_early.append(sum(prompt))


@pytest.fixture(scope="module")
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_schedule_counts_and_bounds() -> None:
    reqs = build_requests(100, seed=3, context=512, vocab=208, max_tokens=64)
    kinds = [r.kind for r in reqs]
    assert (kinds.count("normal"), kinds.count("abort"), kinds.count("over_context"),
            kinds.count("edge")) == (80, 10, 5, 5)
    for r in reqs:
        assert all(4 <= t < 208 for t in r.prompt)
        if r.kind in ("normal", "abort"):
            assert 1 <= len(r.prompt) and len(r.prompt) + r.max_tokens < 512
        if r.kind == "abort":
            assert 1 <= r.abort_after <= r.max_tokens // 2
        if r.kind == "over_context":
            assert len(r.prompt) > 512
        if r.kind == "edge":
            assert len(r.prompt) < 512 < len(r.prompt) + r.max_tokens
    assert len({len(r.prompt) for r in reqs}) > 30  # mixed lengths
    assert reqs == build_requests(100, seed=3, context=512, vocab=208, max_tokens=64)


def test_client_streams_aborts_and_reads_errors(fake_url: str) -> None:
    reqs = [LoadRequest(0, "normal", [1, 2, 3], 10),
            LoadRequest(1, "abort", [7] * 5, 60, abort_after=4),
            LoadRequest(2, "over_context", [1] * (CONTEXT + 1), 5)]
    normal, aborted, over = asyncio.run(fire(fake_url, reqs, 2, 30))
    assert normal.completed and normal.token_ids == [(6 + i) % 100 for i in range(10)]
    assert normal.finish_reason == "length"
    assert aborted.aborted and not aborted.completed
    assert 4 <= len(aborted.token_ids) < 60 and aborted.token_ids == [35 + i for i in range(
        len(aborted.token_ids))]
    assert over.status == 400 and not over.token_ids and "too long" in over.error
    threading.Event().wait(0.5)
    assert 35 in _Fake.closed_early  # the server saw the stream closed


def test_compare() -> None:
    reqs = [LoadRequest(0, "normal", [1], 5), LoadRequest(1, "normal", [2], 5),
            LoadRequest(2, "abort", [3], 20, 3), LoadRequest(3, "over_context", [1] * 9, 2),
            LoadRequest(4, "edge", [1] * 7, 9), LoadRequest(5, "abort", [4], 20, 3),
            LoadRequest(6, "abort", [5], 20, 3)]
    done = Outcome(200, [1, 2], "length")
    ar = [done, done, Outcome(200, [1, 2, 3], None, aborted=True), Outcome(400),
          Outcome(400), Outcome(200, [1, 2, 3], None, aborted=True),
          Outcome(200, [1, 2, 3], None, aborted=True)]
    spec = [done, Outcome(200, [1, 3], "length"), Outcome(200, [1, 2, 3, 4], None,
                                                         aborted=True),
            Outcome(500), Outcome(400), Outcome(200, [1, 2, 3, 4], "stop"),
            Outcome(200, [1, 2, 4, 4], "stop")]
    c = compare(reqs, ar, spec)
    assert c["completed_on_both"] == 2 and c["equal_to_ar"] == 1 and c["mismatches"] == [1, 6]
    assert c["aborted_on_both"] == 1 and c["aborted_prefix_mismatch"] == 0
    assert c["aborted_on_one"] == 2  # 5: the spec server finished first, same tokens
    assert c["over_context_not_rejected"] == [3] and c["edge_inconsistent"] == []
    assert c["normal_not_served"] == []
