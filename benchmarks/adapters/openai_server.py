"""Server adapter: an already running server on loopback (``vllm serve`` or SGLang's
``launch_server``), streaming. Measures TTFT, TPOT and per-user tokens/s per request and
system tokens/s at each concurrency. vLLM: OpenAI ``/v1/completions`` with
``return_token_ids``, spec-decode counters from Prometheus ``/metrics`` around each request.
SGLang: its native ``/generate`` (token ids in, token ids out), per-request counters from
the final chunk's ``meta_info``, and ``avg_spec_accept_length`` from ``/server_info`` (a
running average since the server started) recorded beside them as a cross-check."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from benchmarks.metrics import Completion, RunResult
from diffspec.serving import (
    SpecDecodeCounters,
    http_get,
    sglang_accept_length,
    spec_decode_counters,
    spec_decode_counters_from_sglang,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
def check_loopback(url: str) -> str:
    """The URL without a trailing slash; refuses anything but a loopback host."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"{url}: only a server on loopback ({', '.join(LOOPBACK)}) is driven")
    return url.rstrip("/")


def _counters(base: str) -> SpecDecodeCounters:
    return spec_decode_counters(http_get(base + "/metrics"))


def _event_stream(url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``body`` as JSON and yield each server-sent event's JSON (``data: ...``) until
    ``data: [DONE]`` or the end of the stream."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int) -> Completion:
    """One greedy streaming request; TTFT is the time to the first chunk carrying tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    token_ids: list[int] = []
    ttft, usage_tokens = None, None
    start = time.perf_counter()
    for chunk in _event_stream(base + "/v1/completions", body):
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


def stream_generate(base: str, prompt: list[int], max_tokens: int) -> Completion:
    """One greedy streaming request to SGLang's ``/generate``; counters from ``meta_info``."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens}}
    chunks, ttft = [], None
    start = time.perf_counter()
    for chunk in _event_stream(base + "/generate", body):
        if ttft is None and chunk.get("output_ids"):
            ttft = time.perf_counter() - start
        chunks.append(chunk)
    latency = time.perf_counter() - start
    meta = chunks[-1]["meta_info"]
    last = list(chunks[-1].get("output_ids") or [])
    ids = last if len(last) == meta["completion_tokens"] else [
        t for c in chunks for t in c.get("output_ids") or []]  # incremental streaming
    counters = spec_decode_counters_from_sglang(meta)
    return Completion(token_ids=ids, latency_s=latency, ttft_s=ttft,
                      drafts=int(counters.drafts), draft_tokens=int(counters.draft_tokens),
                      accepted=int(counters.accepted))


def run(baseline: str, url: str, model: str, prompts: list[list[int]], max_tokens: int,
        concurrency: list[int], launch: dict[str, Any] | None = None,
        server: str = "vllm") -> RunResult:
    """Serve ``prompts`` one at a time (per-request latency and counters), then at each
    concurrency c > 1 with c streams in flight (system tokens/s). ``server``: ``vllm`` or
    ``sglang`` (what serves ``url``)."""
    base = check_loopback(url)
    if server == "sglang":
        return _run_sglang(baseline, base, prompts, max_tokens, concurrency, launch)
    completions = []
    start = after = _counters(base)
    for ids in prompts:
        before = _counters(base)
        completion = stream_completion(base, model, ids, max_tokens)
        after = _counters(base)
        d = after - before
        completion.drafts, completion.draft_tokens, completion.accepted = (
            int(d.drafts), int(d.draft_tokens), int(d.accepted))
        completions.append(completion)
    per_pos = [int(a) for a in (after - start).accepted_per_pos] if prompts else []
    system = _system_tokens_per_s(lambda p: stream_completion(base, model, p, max_tokens),
                                  prompts, completions, concurrency)
    return RunResult(
        engine="openai", baseline=baseline,
        launch={"url": base, "model": model, **(launch or {})}, completions=completions,
        system_tokens_per_s=system, accepted_per_pos=per_pos,
        notes=[("OpenAI-compatible server, streaming /v1/completions; counters from /metrics "
               "around the concurrency-1 pass")])


def _system_tokens_per_s(request, prompts: list[list[int]], completions: list[Completion],
                         concurrency: list[int]) -> dict[int, float]:
    tokens = sum(len(c.token_ids) for c in completions)
    system = {1: tokens / max(1e-9, sum(c.latency_s for c in completions))}
    for c in concurrency:
        if c <= 1:
            continue
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=c) as pool:
            outs = list(pool.map(request, prompts))
        system[c] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return system


def _run_sglang(baseline: str, base: str, prompts: list[list[int]], max_tokens: int,
                concurrency: list[int], launch: dict[str, Any] | None) -> RunResult:
    completions = [stream_generate(base, ids, max_tokens) for ids in prompts]
    server_avg = sglang_accept_length(base)
    system = _system_tokens_per_s(lambda p: stream_generate(base, p, max_tokens), prompts,
                                  completions, concurrency)
    return RunResult(
        engine="openai", baseline=baseline, launch={"url": base, "server": "sglang",
                                                    **(launch or {})},
        completions=completions, system_tokens_per_s=system,
        notes=["SGLang server, streaming /generate; counters from each request's meta_info",
               ("/server_info avg_spec_accept_length after the concurrency-1 pass "
                f"(since server start): {server_avg}")])
