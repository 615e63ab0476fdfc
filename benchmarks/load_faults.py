"""Load and faults: a speculative server against a plain-AR server of the same checkpoint.

    python -m benchmarks load-faults --engine vllm --model diffspec/assets/synth-orthrus \\
        --requests 300 --concurrency 16 --out /tmp/load-faults-vllm
    python -m benchmarks load-faults --engine sglang --sglang-cpu-harness ...   # CPU-only box

Starts two OpenAI-compatible servers of one engine on loopback (``diffspec.serving``): plain
AR and the method (default Orthrus) on the same checkpoint, fp32. Fires the same schedule of
greedy streaming ``/v1/completions`` requests (token-id prompts, ``return_token_ids``) at
each, ``--concurrency`` at a time:

* ``normal``: mixed prompt lengths (log-uniform up to half the context), mixed
  ``max_tokens``, prompt + max_tokens inside the context;
* ``abort``: the client closes the stream once it has received ``abort_after`` tokens
  (somewhere in the first half of its budget);
* ``over_context``: a prompt longer than the context: expected a clean 4xx answer;
* ``edge``: a prompt that fits but prompt + max_tokens does not (vLLM clamps max_tokens to
  the context and generates up to its end; SGLang refuses with a 4xx): both servers must
  answer alike.

Then it checks:

* ``servers_up``: both server processes are alive, ``/health`` answers 200 and one more
  request after the load is served (and equals that request's earlier output);
* ``equal_to_ar``: every request that completed on both servers has the same token ids and
  finish reason on the method's server as on the AR server; an aborted request's tokens
  received before the abort agree on their common length; where one server finished a
  request before the client's cut (a speculative server may stream a whole answer in one
  chunk) its output must start with the tokens the other sent before the abort.
  Mismatches are re-sent alone to both servers (recorded, a diagnosis: batch-dependent
  numerics or a bug);
* ``normal_served``: every ``normal`` request completed (200, a finish reason) on both;
* ``over_context_rejected``: every ``over_context`` request got a 4xx on both, no tokens;
* ``edge_consistent``: each ``edge`` request had the same outcome on both servers;
* ``kv_restored``: once idle, each server's KV pool holds as many free slots as at start.
  vLLM: the block pool's free blocks from ``/metrics`` (``vllm:kv_cache_usage_perc`` after
  a one-token probe request, times the usable blocks of ``vllm:cache_config_info``), plus
  the development endpoint ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``,
  loopback only), which succeeds only when every block but the null block is free.
  SGLang: ``/v1/loads`` ``num_used_tokens`` (pool size minus free minus evictable radix
  cache tokens) back to its start value (0); SGLang's scheduler also checks its pools
  itself on every idle pass (``SchedulerInvariantChecker``: available + evictable +
  protected == total, and the request-slot pool) and with
  ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1`` (set here; SGLang's default) raises on a
  leak, killing the server, so a leak also fails ``servers_up``;
* ``no_leak_log``: neither server log carries a leak / engine-death message.

A small KV pool makes the load preempt (vLLM: ``--vllm-arg=--enforce-eager
--vllm-arg=--num-gpu-blocks-override=24``; ``vllm:num_preemptions_total`` is recorded) or
retract (SGLang: ``--sglang-max-total-tokens 1024``; ``--sglang-busy-check`` asserts the
pool invariant on every busy scheduler pass too) running requests.

Prints a table and writes ``load_faults.json`` (every request of both servers) under
``--out``. Exit status 0 when every check passes. Timings are not the point (the load and
the servers share the machine); every loop is bounded (``--request-timeout``,
``--deadline``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import verb_parser
from benchmarks.adapters.sglang_offline import add_sglang_args, sglang_runtime
from diffspec.serving import (
    ServerProcess,
    free_port,
    http_get,
    sglang_accept_length,
    sglang_server_command,
    vllm_server_command,
)

SERVED_NAME = "model"
KINDS = ("normal", "abort", "over_context", "edge")
# lines of a server log that mean a leak or a dead engine
LEAK_PATTERNS = re.compile(
    r"memory leak detected|Mem Leak Detected|KV double free|use-after-free|"
    r"EngineDeadError|Engine core proc .* died|Scheduler hit an exception",
    re.IGNORECASE)


# ------------------------------------------------------------------------------ requests


@dataclass
class LoadRequest:
    idx: int
    kind: str
    prompt: list[int]
    max_tokens: int
    abort_after: int | None = None  # abort: close the stream after this many tokens


@dataclass
class Outcome:
    """What one server answered to one request."""

    status: int | None = None  # HTTP status (None: no answer: connection error / timeout)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False  # the client closed the stream
    chunks: int = 0  # stream chunks that carried tokens (about one per engine step)
    error: str | None = None
    seconds: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and not self.aborted and self.finish_reason is not None \
            and self.error is None


def _checkpoint_info(model: Path) -> tuple[int, int]:
    """(vocab size, context length) of ``config.json``."""
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config") or config
    return int(text["vocab_size"]), int(text.get("max_position_embeddings") or 2048)


def _synthetic_ids(model: Path, n: int, seed: int) -> list[list[int]] | None:
    """Prompts of the bundled synthetic language (the tiny checkpoints' training text,
    whose drafts are accepted in long runs), when ``model`` has that tokenizer."""
    try:
        from transformers import AutoTokenizer

        from diffspec.testing.synthetic import build_tokenizer, sample_prompts
    except ImportError:
        return None
    try:
        if AutoTokenizer.from_pretrained(str(model)).get_vocab() != build_tokenizer().get_vocab():
            return None
    except (OSError, ValueError):
        return None
    tokenizer = build_tokenizer()
    return [tokenizer(p).input_ids for p in sample_prompts(n, seed=seed)]


def build_requests(n: int, *, seed: int, context: int, vocab: int,
                   token_range: tuple[int, int] | None = None, abort_frac: float = 0.1,
                   over_frac: float = 0.05, edge_frac: float = 0.05, max_tokens: int = 96,
                   synthetic: list[list[int]] | None = None) -> list[LoadRequest]:
    """``n`` requests in a shuffled order: ``abort_frac`` aborted streams, ``over_frac``
    prompts over the context, ``edge_frac`` prompt + max_tokens over the context, the rest
    normal. Prompts: random token ids in ``token_range`` (default: the upper 3/4 of the
    vocabulary, above special tokens), half of them (when given) from ``synthetic`` prompts
    concatenated to the length."""
    rng = random.Random(seed)
    lo, hi = token_range or (max(4, vocab // 4 if vocab > 1000 else 4), vocab)
    counts = {"abort": round(n * abort_frac), "over_context": round(n * over_frac),
              "edge": round(n * edge_frac)}
    counts["normal"] = n - sum(counts.values())
    if counts["normal"] < 0:
        raise ValueError("the fractions of aborted, over-context and edge requests exceed 1")
    kinds = [k for k in KINDS for _ in range(counts[k])]
    rng.shuffle(kinds)

    def prompt(length: int) -> list[int]:
        if synthetic and rng.random() < 0.5:
            ids: list[int] = []
            while len(ids) < length:
                ids += synthetic[rng.randrange(len(synthetic))]
            return ids[:length]
        return [rng.randrange(lo, hi) for _ in range(length)]

    def log_uniform(a: int, b: int) -> int:
        return min(b, max(a, int(math.exp(rng.uniform(math.log(a), math.log(b + 1))))))

    requests = []
    for idx, kind in enumerate(kinds):
        if kind == "over_context":
            length = context + rng.randint(1, 64)
            requests.append(LoadRequest(idx, kind, prompt(length), rng.randint(1, max_tokens)))
        elif kind == "edge":
            room = rng.randint(2, max(2, min(max_tokens, context // 4)))  # tokens left
            requests.append(LoadRequest(idx, kind, prompt(context - room),
                                        room + rng.randint(1, max_tokens)))
        else:
            budget = rng.randint(16 if kind == "abort" else 1, max_tokens)
            length = log_uniform(1, max(1, min(context // 2, context - budget - 1)))
            abort_after = rng.randint(1, max(1, budget // 2)) if kind == "abort" else None
            requests.append(LoadRequest(idx, kind, prompt(length), budget, abort_after))
    return requests


# -------------------------------------------------------------------------------- client


async def send(client: Any, base: str, request: LoadRequest, timeout: float) -> Outcome:
    """One greedy streaming ``/v1/completions`` request; closes the stream early for an
    ``abort`` request once ``abort_after`` tokens arrived."""
    import httpx

    body = {"model": SERVED_NAME, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "stream": True, "return_token_ids": True}
    out = Outcome()
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", base + "/v1/completions", json=body) as response:
                out.status = response.status_code
                if response.status_code != 200:
                    out.error = (await response.aread()).decode(errors="replace")[:300]
                    return out
                async for line in response.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk or chunk.get("object") == "error":
                        out.error = json.dumps(chunk)[:300]
                        break
                    for choice in chunk.get("choices") or []:
                        out.chunks += bool(choice.get("token_ids"))
                        out.token_ids += choice.get("token_ids") or []
                        out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if (request.abort_after is not None and out.finish_reason is None
                            and len(out.token_ids) >= request.abort_after):
                        out.aborted = True  # leaving the block closes the connection
                        break
    except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        out.seconds = time.monotonic() - start
    return out


async def fire(base: str, requests: list[LoadRequest], concurrency: int,
               timeout: float) -> list[Outcome]:
    """Every request, ``concurrency`` in flight at a time, in list order."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout)) as client:
        async def one(request: LoadRequest) -> Outcome:
            async with semaphore:
                return await send(client, base, request, timeout)

        return list(await asyncio.gather(*(one(r) for r in requests)))


def _post(url: str, body: Any = None, timeout: float = 30) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:  # no answer: refused, reset, timed out
        return 0, f"{type(e).__name__}: {e}"


def one_request(base: str, prompt: list[int], max_tokens: int,
                timeout: float = 120) -> tuple[int, list[int]]:
    """A non-streaming greedy request: (status, token ids)."""
    status, text = _post(base + "/v1/completions", {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True}, timeout)
    if status != 200:
        return status, []
    return status, json.loads(text)["choices"][0].get("token_ids") or []


# ---------------------------------------------------------------------------- KV pool


def _vllm_kv(base: str) -> dict[str, Any]:
    """vLLM: free blocks now, from ``/metrics`` (usage gauge x usable blocks)."""
    from prometheus_client.parser import text_string_to_metric_families

    usage, blocks, running, waiting, preemptions = 0.0, None, 0.0, 0.0, 0.0
    for family in text_string_to_metric_families(http_get(base + "/metrics")):
        for s in family.samples:
            if s.name == "vllm:kv_cache_usage_perc":
                usage += float(s.value)
            elif s.name == "vllm:cache_config_info" and "num_gpu_blocks" in s.labels:
                blocks = int(s.labels["num_gpu_blocks"])
            elif s.name == "vllm:num_requests_running":
                running += float(s.value)
            elif s.name == "vllm:num_requests_waiting":
                waiting += float(s.value)
            elif s.name == "vllm:num_preemptions_total":
                preemptions += float(s.value)
    usable = None if blocks is None else blocks - 1  # the null block is never free
    free = None if usable is None else round((1.0 - usage) * usable)
    return {"usage": usage, "usable_blocks": usable, "free_blocks": free,
            "running": running, "waiting": waiting, "preemptions": preemptions}


def vllm_kv_idle(base: str, timeout: float = 60) -> dict[str, Any]:
    """Once idle: a one-token probe request (the scheduler's stats, read by ``/metrics``,
    are taken after a step frees its finished requests; aborts alone publish none), then
    the free blocks, then ``POST /reset_prefix_cache`` (succeeds only when every block is
    free). Retried until the pool is whole or ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        one_request(base, [5], 1)
        state = _vllm_kv(base)
        status, text = _post(base + "/reset_prefix_cache")
        try:
            state["reset_prefix_cache"] = bool(json.loads(text).get("success")) \
                if status == 200 else f"HTTP {status}"
        except ValueError:
            state["reset_prefix_cache"] = text[:100]
        whole = state["usage"] == 0.0 and state["reset_prefix_cache"] is True
        if whole or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def _sglang_loads(base: str) -> dict[str, Any]:
    loads = json.loads(http_get(base + "/v1/loads"))["loads"]
    total = sum(int(x.get("max_total_num_tokens") or 0) for x in loads)
    used = sum(int(x.get("num_used_tokens") or 0) for x in loads)
    return {"total_tokens": total, "used_tokens": used, "free_tokens": total - used,
            "running": sum(int(x.get("num_running_reqs") or 0) for x in loads),
            "waiting": sum(int(x.get("num_waiting_reqs") or 0) for x in loads)}


def sglang_kv_idle(base: str, timeout: float = 60) -> dict[str, Any]:
    """SGLang, once idle: ``/v1/loads`` (free = pool - used, used excluding the evictable
    radix cache), retried until no request runs or waits and nothing is used, or
    ``timeout``. (The scheduler's own idle check has run by then: it precedes the idle
    load snapshot.)"""
    deadline = time.monotonic() + timeout
    while True:
        state = _sglang_loads(base)
        idle = state["running"] == 0 and state["waiting"] == 0 and state["used_tokens"] == 0
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def kv_idle(engine: str, base: str, timeout: float = 60) -> dict[str, Any]:
    """The engine's idle KV reading; ``{"error": ...}`` when the server does not answer."""
    try:
        return vllm_kv_idle(base, timeout) if engine == "vllm" else sglang_kv_idle(base, timeout)
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def kv_free(engine: str, state: dict[str, Any]) -> int | None:
    return state.get("free_blocks") if engine == "vllm" else state.get("free_tokens")


# ---------------------------------------------------------------------------- servers


def _flags(kwargs: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def server_commands(args: argparse.Namespace, context: int) -> dict[str, tuple]:
    """``{"ar": (cmd, port, env), "spec": (...)}`` for ``args.engine``."""
    from diffspec.methods import get_method

    method = get_method(args.method)
    entry = method.engine(args.engine)
    if entry is None:
        raise SystemExit(f"load_faults: {args.method} is not served by {args.engine}")
    if args.engine == "vllm" and entry.flag != "--speculative-config":
        raise SystemExit(f"load_faults: {args.method} runs on vLLM's diffusion path "
                         f"({entry.flag}), which load_faults does not drive")
    k = args.num_draft_tokens
    commands = {}
    if args.engine == "vllm":
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        common = ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--seed", "0",
                  "--max-model-len", str(context),
                  *(args.vllm_arg if args.vllm_arg is not None else ["--enforce-eager"])]
        if args.block_size:
            common += ["--block-size", str(args.block_size)]
        spec = {"method": entry.name, **({"num_speculative_tokens": k} if k else {})}
        for name, extra in (("ar", []), ("spec", ["--speculative-config", json.dumps(spec)])):
            port = free_port()
            commands[name] = (vllm_server_command(args.model, port, *common, *extra,
                                                  python=args.vllm_python), port, env)
        return commands
    python, env, kwargs = sglang_runtime(args)
    env = {**env, "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    if args.sglang_busy_check:
        env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    kwargs.update({"dtype": "float32", "served_model_name": SERVED_NAME,
                   "context_length": context, "max_total_tokens": args.sglang_max_total_tokens,
                   "random_seed": 0, "skip_server_warmup": True,
                   # SGLang adds the acceptance counters up at each decode log line
                   "decode_log_interval": 1})
    common = [*_flags(kwargs), *args.sglang_arg]
    spec = ["--speculative-algorithm", entry.name]
    if k:
        spec += ["--speculative-num-draft-tokens", str(k + 1)]  # the anchor + K drafts
    for name, extra in (("ar", []), ("spec", spec)):
        port = free_port()
        commands[name] = (sglang_server_command(args.model, port, *common, *extra,
                                                python=python), port, env)
    return commands


def _alive(server: ServerProcess) -> bool:
    if server.proc.poll() is not None:
        return False
    try:
        http_get(server.url + "/health", timeout=10)
        return True
    except OSError:
        return False


def _acceptance_length(engine: str, server: ServerProcess) -> float | None:
    """Tokens per verify step since the server started (None: no verify step, or AR)."""
    try:
        if engine == "vllm":
            return server.spec_decode_counters().acceptance_length
        # SGLang: /v1/loads (accepted tokens / verify forwards, the scheduler's totals as
        # of its last decode log line)
        for load in json.loads(http_get(server.url + "/v1/loads"))["loads"]:
            if (load.get("speculative") or {}).get("accept_length") is not None:
                return float(load["speculative"]["accept_length"])
        return sglang_accept_length(server.url)
    except (OSError, ValueError, KeyError):
        return None


def _leak_lines(server: ServerProcess) -> list[str]:
    if not server._log.closed:
        server._log.flush()
    text = server.log_path.read_text(errors="replace")
    return [line.strip()[:300] for line in text.splitlines() if LEAK_PATTERNS.search(line)]


# ------------------------------------------------------------------------------- checks


def compare(requests: list[LoadRequest], ar: list[Outcome],
            spec: list[Outcome]) -> dict[str, Any]:
    """Counts and the offending request indices, per check."""
    both_done = equal = aborted = aborted_prefix_bad = one_side = 0
    mismatches: list[int] = []
    normal_bad: list[int] = []
    over_bad: list[int] = []
    edge_bad: list[int] = []
    for r, a, s in zip(requests, ar, spec, strict=True):
        if r.kind == "over_context":
            if not all(o.status is not None and 400 <= o.status < 500 and not o.token_ids
                       for o in (a, s)):
                over_bad.append(r.idx)
            continue
        if r.kind == "normal" and not (a.completed and s.completed):
            normal_bad.append(r.idx)
        if r.kind == "edge" and (a.status != s.status or a.completed != s.completed
                                 or a.status is None or a.status >= 500):
            edge_bad.append(r.idx)
        if a.aborted and s.aborted:
            aborted += 1
            n = min(len(a.token_ids), len(s.token_ids))
            if a.token_ids[:n] != s.token_ids[:n]:
                aborted_prefix_bad += 1
                mismatches.append(r.idx)
        elif a.aborted or s.aborted:
            # aborted on one server; the other finished first (a speculative server can
            # stream the whole answer in one chunk): the tokens received must agree
            one_side += 1
            cut, whole = (a, s) if a.aborted else (s, a)
            if not whole.completed or whole.token_ids[:len(cut.token_ids)] != cut.token_ids:
                mismatches.append(r.idx)
        elif a.completed and s.completed:
            both_done += 1
            if a.token_ids == s.token_ids and a.finish_reason == s.finish_reason:
                equal += 1
            else:
                mismatches.append(r.idx)
    return {"completed_on_both": both_done, "equal_to_ar": equal,
            "aborted_on_both": aborted, "aborted_prefix_mismatch": aborted_prefix_bad,
            "aborted_on_one": one_side,
            "mismatches": mismatches, "normal_not_served": normal_bad,
            "over_context_not_rejected": over_bad, "edge_inconsistent": edge_bad}


def run_load(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Start both servers, drive them, check; the report (``report["ok"]``: all passed)."""
    model = Path(args.model).expanduser().resolve()
    vocab, context = _checkpoint_info(model)
    context = args.max_model_len or context
    synthetic = None if args.prompts == "random" else _synthetic_ids(model, 64, args.seed)
    if args.prompts == "synthetic" and synthetic is None:
        raise SystemExit(f"load_faults: {model} does not use the synthetic tokenizer")
    requests = build_requests(args.requests, seed=args.seed, context=context, vocab=vocab,
                              token_range=tuple(args.token_range) if args.token_range else None,
                              abort_frac=args.abort_fraction, over_frac=args.over_context_fraction,
                              edge_frac=args.edge_fraction, max_tokens=args.max_tokens,
                              synthetic=synthetic)
    commands = server_commands(args, context)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    servers: dict[str, ServerProcess] = {}
    report: dict[str, Any] = {
        "engine": args.engine, "model": str(model), "method": args.method,
        "num_draft_tokens": args.num_draft_tokens, "context": context,
        "concurrency": args.concurrency, "requests": len(requests),
        "kinds": {k: sum(r.kind == k for r in requests) for k in KINDS},
        "commands": {n: c[0] for n, c in commands.items()}, "servers": {}}
    t0 = time.monotonic()
    try:
        for name, (cmd, port, env) in commands.items():  # both start at once
            servers[name] = ServerProcess(
                cmd, port, engine=args.engine, env=env,
                log_path=(out / f"{name}-server.log") if out else None)
        for name, server in servers.items():
            server.wait_ready(args.ready_timeout)
            log(f"[load_faults] {args.engine} {name} server ready at {server.url} "
                f"({time.monotonic() - t0:.0f} s)")
        report["ready_s"] = round(time.monotonic() - t0, 1)
        outcomes: dict[str, list[Outcome]] = {}
        for name, server in servers.items():
            info: dict[str, Any] = {"log": str(server.log_path)}
            info["kv_start"] = kv_idle(args.engine, server.url, args.idle_timeout)
            start = time.monotonic()
            outcomes[name] = asyncio.run(asyncio.wait_for(
                fire(server.url, requests, args.concurrency, args.request_timeout),
                args.deadline))
            info["load_s"] = round(time.monotonic() - start, 1)
            info["kv_idle"] = kv_idle(args.engine, server.url, args.idle_timeout)
            info["kv_free_start"] = kv_free(args.engine, info["kv_start"])
            info["kv_free_idle"] = kv_free(args.engine, info["kv_idle"])
            info["generated_tokens"] = sum(len(o.token_ids) for o in outcomes[name])
            info["aborted"] = sum(o.aborted for o in outcomes[name])
            done = [o for o in outcomes[name] if o.completed]
            info["tokens_per_chunk"] = round(sum(len(o.token_ids) for o in done)
                                             / max(1, sum(o.chunks for o in done)), 2)
            info["status_counts"] = {}
            for o in outcomes[name]:
                key = str(o.status)
                info["status_counts"][key] = info["status_counts"].get(key, 0) + 1
            report["servers"][name] = info
            log(f"[load_faults] {name}: {len(requests)} requests in {info['load_s']} s, "
                f"KV free {info['kv_free_start']} -> {info['kv_free_idle']}")
        # after the load: still up, and one more request is served as before
        first = next(r for r in requests if r.kind == "normal")
        for name, server in servers.items():
            info = report["servers"][name]
            again = one_request(server.url, first.prompt, first.max_tokens)
            info["post_load_request_equal"] = (again[0] == 200 and again[1]
                                               == outcomes[name][first.idx].token_ids)
            info["alive"] = _alive(server)
            info["acceptance_length"] = _acceptance_length(args.engine, server)
            info["leak_log_lines"] = _leak_lines(server)
        result = compare(requests, outcomes["ar"], outcomes["spec"])
        # a mismatch re-sent alone to both servers: batch-dependent numerics or a bug
        result["rechecks"] = []
        for i in result["mismatches"][:args.max_rechecks]:
            r = requests[i]
            alone = {n: one_request(s.url, r.prompt, r.max_tokens)[1] for n, s in servers.items()}
            result["rechecks"].append({"idx": i, "alone_equal": alone["ar"] == alone["spec"],
                                       "spec_equal_to_its_load_output":
                                           alone["spec"] == outcomes["spec"][i].token_ids,
                                       "ar_equal_to_its_load_output":
                                           alone["ar"] == outcomes["ar"][i].token_ids})
        report["compare"] = result
        report["checks"] = {
            "servers_up": all(s["alive"] and s["post_load_request_equal"]
                              for s in report["servers"].values()),
            "equal_to_ar": not result["mismatches"],
            "normal_served": not result["normal_not_served"],
            "over_context_rejected": not result["over_context_not_rejected"],
            "edge_consistent": not result["edge_inconsistent"],
            "kv_restored": all(_kv_ok(args.engine, s) for s in report["servers"].values()),
            "no_leak_log": not any(s["leak_log_lines"] for s in report["servers"].values()),
        }
        report["ok"] = all(report["checks"].values())
        report["requests_detail"] = [
            {**{k: v for k, v in asdict(r).items() if k != "prompt"},
             "prompt_len": len(r.prompt),
             **{n: {**asdict(o), "num_tokens": len(o.token_ids)} for n, o in
                (("ar", outcomes["ar"][r.idx]), ("spec", outcomes["spec"][r.idx]))}}
            for r in requests]
    except BaseException as e:
        report["ok"] = False
        report["error"] = f"{type(e).__name__}: {e}"[-4000:]
        raise
    finally:
        for server in servers.values():
            server.stop()
        report["total_s"] = round(time.monotonic() - t0, 1)
        if out:
            (out / "load_faults.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _kv_ok(engine: str, info: dict[str, Any]) -> bool:
    start, idle = info["kv_start"], info["kv_idle"]
    if "error" in start or "error" in idle:
        return False
    if engine == "vllm":
        return (idle["free_blocks"] is not None and idle["free_blocks"] == start["free_blocks"]
                and idle["usage"] == 0.0 and idle["reset_prefix_cache"] is True)
    return idle["free_tokens"] == start["free_tokens"] and idle["used_tokens"] == 0 \
        and idle["total_tokens"] > 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(report: dict[str, Any]) -> str:
    unit = "blocks" if report["engine"] == "vllm" else "tokens"
    c = report["compare"]
    lines = [(f"load and faults: {report['engine']} {report['method']} on {report['model']} "
             f"(context {report['context']}, concurrency {report['concurrency']})"),
             f"requests {report['requests']}: " + ", ".join(
                 f"{k} {v}" for k, v in report["kinds"].items()),
             ("| server | load s | 200 / 4xx / other | aborted | tokens | tok/chunk | acc. length | "
              f"KV free start ({unit}) | KV free idle | alive |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["servers"].items():
        ok = s["status_counts"].get("200", 0)
        bad4 = sum(v for k, v in s["status_counts"].items() if k.startswith("4"))
        other = sum(s["status_counts"].values()) - ok - bad4
        lines.append(f"| {name} | {s['load_s']} | {ok} / {bad4} / {other} | {s['aborted']} | "
                     f"{s['generated_tokens']} | {s['tokens_per_chunk']} | "
                     f"{_fmt(s['acceptance_length'])} | "
                     f"{s['kv_free_start']} | {s['kv_free_idle']} | "
                     f"{s['alive']} |")
    lines.append(f"completed on both: {c['completed_on_both']}, equal to AR: {c['equal_to_ar']}; "
                 f"aborted on both: {c['aborted_on_both']} (prefix mismatches "
                 f"{c['aborted_prefix_mismatch']}), on one (the other finished first): "
                 f"{c['aborted_on_one']}; mismatches: {c['mismatches'] or 'none'}")
    lines += [f"  {'PASS' if v else 'FAIL'} {k}" for k, v in report["checks"].items()]
    return "\n".join(lines)


# the load: flag, default (its type the option's), what it sets
LOAD_MIX: tuple[tuple[str, int | float, str], ...] = (
    ("--requests", 300, "requests per server"),
    ("--concurrency", 16, "requests in flight at once"),
    ("--max-tokens", 96, "largest max_tokens of a request (each draws 1..this)"),
    ("--abort-fraction", 0.1, "share of streams the client closes mid-way"),
    ("--over-context-fraction", 0.05, "share of prompts longer than the context (expected: 4xx)"),
    ("--edge-fraction", 0.05, "share of prompts that fit but prompt + max_tokens does not"),
)
# what the run waits for, in seconds
LOAD_LIMITS: tuple[tuple[str, float, str], ...] = (
    ("--request-timeout", 300.0, "seconds per request"),
    ("--deadline", 3600.0, "seconds for the whole load on one server"),
    ("--ready-timeout", 600.0, "seconds for a server to start"),
    ("--idle-timeout", 60.0, "seconds for the KV pool to be whole again once the load ended"),
)


def parser() -> argparse.ArgumentParser:
    p = verb_parser(
        "load-faults",
        description="Start a plain-AR server and a speculative server (same engine, same "
        "checkpoint, loopback, fp32), fire the same mixed load of greedy streaming requests "
        "at each (some streams aborted mid-way, some prompts over the context), then check: "
        "both servers stay up, every completed output of the speculative server equals the "
        "AR server's token for token, over-context prompts get a clean 4xx, and once idle "
        "each KV pool has as many free slots as at start. Prints a table, writes JSON; exit "
        "status 0 when every check passes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    p.add_argument("--model", default=str(ROOT / "diffspec" / "assets" / "synth-orthrus"),
                   help="checkpoint served by both servers")
    p.add_argument("--method", default="orthrus",
                   help="diffspec method of the speculative server (orthrus, linear_self_spec, "
                   "tidar)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="drafts per step K (None: the method's, the checkpoint's block - 1)")
    for flag, default, text in LOAD_MIX + LOAD_LIMITS:
        p.add_argument(flag, type=type(default), default=default, help=text)
    p.add_argument("--prompts", choices=("auto", "random", "synthetic"), default="auto",
                   help="random token ids; or half of them from the bundled synthetic "
                   "language (the tiny checkpoints' text, long accepted runs); auto: "
                   "synthetic when the checkpoint has that tokenizer")
    p.add_argument("--token-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="random prompt ids in [LO, HI) (None: above the special tokens)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the servers' context (None: the checkpoint's "
                   "max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block size (0: vLLM's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request schedule")
    p.add_argument("--max-rechecks", type=int, default=8,
                   help="mismatching requests re-sent alone to both servers (diagnosis)")
    p.add_argument("--vllm-python", default=None, help="interpreter with vLLM (None: this one)")
    p.add_argument("--vllm-arg", action="append", default=None,
                   help="one more vLLM server argument (repeat; None: --enforce-eager; "
                   "given ones replace it)")
    add_sglang_args(p)
    p.add_argument("--sglang-max-total-tokens", type=int, default=8192,
                   help="SGLang KV pool size in tokens")
    p.add_argument("--sglang-busy-check", action="store_true",
                   help="also SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1 (pool invariant "
                   "asserted on every busy scheduler pass)")
    p.add_argument("--sglang-arg", action="append", default=[],
                   help="one more SGLang server argument (repeat)")
    p.add_argument("--out", default=None, help="folder for load_faults.json and server logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    report = run_load(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(report))
    if args.out:
        print(f"wrote {Path(args.out) / 'load_faults.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
