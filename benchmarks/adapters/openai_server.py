"""OpenAI-compatible server adapter: an already running server (``vllm serve``; SGLang once
its plugin lands) on loopback, driven with streaming ``/v1/completions``. Measures TTFT,
TPOT and per-user tokens/s per request, system tokens/s at each concurrency, and reads the
spec-decode counters from the server's Prometheus ``/metrics`` around each request."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from benchmarks.metrics import Completion, RunResult

LOOPBACK = ("127.0.0.1", "localhost", "::1")
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def check_loopback(url: str) -> str:
    """The URL without a trailing slash; refuses anything but a loopback host."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"{url}: only a server on loopback ({', '.join(LOOPBACK)}) is driven")
    return url.rstrip("/")


def read_counters(metrics_text: str) -> tuple[dict[str, float], list[int]]:
    """Spec-decode counters from a Prometheus text page (summed over label sets; missing
    counters read 0) and accepted tokens per draft position."""
    values = {name: 0.0 for name in COUNTERS}
    per_pos: dict[int, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name in values:
            values[name] += float(value)
        elif name == PER_POS and 'position="' in name_labels:
            pos = int(name_labels.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
    return values, [int(per_pos[p]) for p in sorted(per_pos)]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int) -> Completion:
    """One greedy streaming request; TTFT is the time to the first chunk carrying tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    token_ids: list[int] = []
    ttft, usage_tokens = None, None
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and ttft is None:
                    ttft = time.perf_counter() - start
                token_ids.extend(ids)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
    latency = time.perf_counter() - start
    if usage_tokens is not None and len(token_ids) != usage_tokens:
        raise RuntimeError(f"server streamed {len(token_ids)} token ids but reports "
                           f"{usage_tokens} completion tokens (does it honour return_token_ids?)")
    return Completion(token_ids=token_ids, latency_s=latency, ttft_s=ttft)


def run(baseline: str, url: str, model: str, prompts: list[list[int]], max_tokens: int,
        concurrency: list[int], launch: dict[str, Any] | None = None) -> RunResult:
    """Serve ``prompts`` one at a time (per-request latency and counters), then at each
    concurrency c > 1 with c streams in flight (system tokens/s)."""
    base = check_loopback(url)
    completions = []
    _, per_pos_start = read_counters(_get(base + "/metrics"))
    for ids in prompts:
        before, _ = read_counters(_get(base + "/metrics"))
        completion = stream_completion(base, model, ids, max_tokens)
        after, per_pos = read_counters(_get(base + "/metrics"))
        d = [int(after[k] - before[k]) for k in COUNTERS]
        completion.drafts, completion.draft_tokens, completion.accepted = d
        completions.append(completion)
    per_pos = [a - (per_pos_start[i] if i < len(per_pos_start) else 0)
               for i, a in enumerate(per_pos)] if prompts else []
    tokens = sum(len(c.token_ids) for c in completions)
    system = {1: tokens / max(1e-9, sum(c.latency_s for c in completions))}
    for c in concurrency:
        if c <= 1:
            continue
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=c) as pool:
            outs = list(pool.map(lambda p: stream_completion(base, model, p, max_tokens), prompts))
        system[c] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return RunResult(
        engine="openai", baseline=baseline,
        launch={"url": base, "model": model, **(launch or {})}, completions=completions,
        system_tokens_per_s=system, accepted_per_pos=per_pos,
        notes=[("OpenAI-compatible server, streaming /v1/completions; counters from /metrics "
               "around the concurrency-1 pass")])
