"""What the server suites (``test_vllm_servers.py``, ``test_sglang_servers.py``) share: the
checkpoint copies with generation_config.json sampling defaults, and HTTP calls as clients
make them (plain JSON, server-sent events, a stream dropped mid-way, the OpenAI SDK).

Every call returns ``(status, body)`` and never raises on an HTTP error status: a case
asserts the status it expects, so a 500 fails the case by its code, with the body.
"""

from __future__ import annotations

import http.client
import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["QWEN3_SAMPLING", "abort_stream", "post", "stream", "with_sampling_defaults"]

# Qwen3's generation_config.json sampling defaults (ReFusion's stock-Qwen3 layout, Orthrus /
# TiDAR Qwen3 checkpoints): what vLLM's and SGLang's OpenAI servers fill a request's gaps with
QWEN3_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def with_sampling_defaults(src: Path, dst: Path, sampling: dict[str, Any]) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` whose generation_config.json carries
    ``sampling`` (next to its EOS ids), as published checkpoints do."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, **sampling}, indent=2))
    return dst


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, Any]:
    """POST ``body`` as JSON; ``(status, parsed body)`` (the raw text if not JSON)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def stream(url: str, body: dict, timeout: float = 300) -> tuple[int, list[dict]]:
    """POST ``body`` with ``"stream": true``; ``(status, the server-sent events' JSON
    objects)`` up to ``[DONE]`` (an error status: its body as the only event)."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return exc.code, [{"error": exc.read().decode(errors="replace")}]
    events = []
    with response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            events.append(json.loads(data))
    return response.status, events


def abort_stream(url: str, body: dict, events: int = 1, timeout: float = 300) -> int:
    """Start a streamed request, read ``events`` server-sent events, then close the
    connection as a client that goes away does; returns the events read."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    conn.request("POST", parts.path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    seen = 0
    while seen < events:
        line = response.readline()
        if not line:
            break
        seen += line.startswith(b"data:")
    conn.close()  # mid-stream: the server must abort the request and serve on
    return seen
