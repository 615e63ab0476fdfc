"""The benchmark driver: one prompt set, every baseline on every engine, one report.

Each engine has one adapter (``benchmarks/adapters``); every figure comes from the shared
metrics (``benchmarks/metrics.py``), and every speed row carries its lossless column: the
fraction of prompts whose greedy output equals the same engine's AR output.

    python benchmarks/driver.py --dataset gsm8k --num-prompts 8 --engines reference,vllm \\
        --baselines ar,ngram,orthrus --out benchmarks/results/run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.datasets import DATASETS, DEFAULT_PATHS, Prompt, load_prompts
from benchmarks.metrics import RunResult, category_table, markdown_table, summarize

ENGINES = ("reference", "vllm", "openai")
REFERENCE_BASELINES = ("ar", "ngram", "orthrus", "linear_self_spec", "tidar")
VLLM_BASELINES = ("ar", "ngram", "orthrus", "linear_self_spec", "eagle3")


def _default_model() -> str:
    from diffspec.assets import SYNTH_ORTHRUS_DIR

    return str(SYNTH_ORTHRUS_DIR)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/driver.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        epilog=(
            "engines:\n"
            "  reference  diffspec's reference decoder, in-process, concurrency 1 only;\n"
            f"             baselines {', '.join(REFERENCE_BASELINES)}\n"
            "  vllm       vllm.LLM in a subprocess, counters from llm.get_metrics();\n"
            f"             baselines {', '.join(VLLM_BASELINES)} (eagle3 needs --eagle3-drafter)\n"
            "  openai     an already running OpenAI-compatible server on loopback\n"
            "             (--openai-url; lossless column needs --openai-ar-url)\n"
            "SGLang is not integrated yet: no sglang adapter.\n\n"
            "metrics: acceptance length = 1 + accepted drafts / verify steps (engine counters);\n"
            "TPF = tokens / forwards after prefill (self-spec step = draft + verify = 2);\n"
            "tok/s/user at concurrency 1; system tok/s at each --concurrency; TTFT / TPOT\n"
            "where the engine exposes them; lossless = exact-match rate vs the engine's AR."
        ),
    )
    p.add_argument("--model", default=None,
                   help="local checkpoint (default: the bundled synth-orthrus)")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k",
                   help="gsm8k / humaneval (shared data), speed-bench (local JSONL or JSON list "
                   "of SPEED-Bench rows; prompt = turns[0]), jsonl ({\"prompt\": ...} rows)")
    p.add_argument("--data-path", default=None, help="dataset file; default for gsm8k: "
                   f"{DEFAULT_PATHS['gsm8k']}, humaneval: {DEFAULT_PATHS['humaneval']}")
    p.add_argument("--categories", type=_csv, default=None,
                   help="keep only these categories (comma-separated)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts to run (SPEED-Bench: spread over categories)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512,
                   help="context length; prompts are cut (their last tokens kept) to fit")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens for every prompt (no stop on EOS)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of the reference decoder (default 1)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--engines", type=_csv, default=["reference"],
                   help=f"comma-separated from {', '.join(ENGINES)} (default: reference)")
    p.add_argument("--baselines", type=_csv, default=["ar", "ngram", "orthrus"],
                   help="comma-separated methods (AR always runs: it is the lossless oracle)")
    p.add_argument("--num-draft-tokens", type=int, default=31,
                   help="drafts per step for every speculative baseline (default 31)")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in _csv(t)], default=[1, 2, 4],
                   help="system tokens/s at these concurrencies (default 1,2,4)")
    p.add_argument("--eagle3-drafter", default=None,
                   help="EAGLE-3 drafter checkpoint: adds vLLM's eagle3 baseline")
    p.add_argument("--openai-url", default=None, help="loopback server running the method")
    p.add_argument("--openai-ar-url", default=None, help="loopback server running plain AR")
    p.add_argument("--openai-model", default=None, help="served model name (default: --model)")
    p.add_argument("--openai-baseline", default="method",
                   help="name of the --openai-url server's configuration in the report")
    p.add_argument("--profile", type=Path, default=None,
                   help="forward_latency.json of profile_forward.py: add the recommended "
                   "block size per baseline")
    p.add_argument("--out", type=Path, default=None, help="folder for report.json / report.md")
    return p


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"nproc": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version()}


def tokenize(prompts: list[Prompt], model: str, chat: bool,
             budget: int) -> tuple[list[list[int]], int]:
    """Token ids of each prompt, cut to its last ``budget`` tokens; (ids, number cut)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids, cut = [], 0
    for p in prompts:
        text = p.text
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
        cut += len(tokens) > budget
        ids.append(tokens[-budget:])
    return ids, cut


def run_engines(args: argparse.Namespace, model: str, ids: list[list[int]]) -> list[RunResult]:
    """Every (engine, baseline) run; AR first on each engine."""
    baselines = ["ar", *[b for b in args.baselines if b != "ar"]]
    if args.eagle3_drafter and "eagle3" not in baselines:
        baselines.append("eagle3")
    results: list[RunResult] = []
    for engine in args.engines:
        if engine == "reference":
            from benchmarks.adapters import reference

            for b in baselines:
                if b in REFERENCE_BASELINES:
                    print(f"[reference] {b} ...", file=sys.stderr, flush=True)
                    results.append(reference.run(b, model, ids, args.max_tokens,
                                                 args.num_draft_tokens, args.ignore_eos,
                                                 args.threads))
        elif engine == "vllm":
            from benchmarks.adapters import vllm_offline

            chosen = [b for b in baselines if b in VLLM_BASELINES
                      and (b != "eagle3" or args.eagle3_drafter)]
            print(f"[vllm] {', '.join(chosen)} ...", file=sys.stderr, flush=True)
            results += vllm_offline.run(chosen, model, ids, args.max_tokens,
                                        args.num_draft_tokens, args.concurrency,
                                        args.max_model_len, args.eagle3_drafter,
                                        ignore_eos=args.ignore_eos)
        elif engine == "openai":
            from benchmarks.adapters import openai_server

            if not args.openai_url:
                raise SystemExit("driver: --engines openai needs --openai-url")
            served = args.openai_model or model
            if args.openai_ar_url:
                results.append(openai_server.run("ar", args.openai_ar_url, served, ids,
                                                 args.max_tokens, args.concurrency))
            results.append(openai_server.run(args.openai_baseline, args.openai_url, served, ids,
                                             args.max_tokens, args.concurrency))
        else:
            raise SystemExit(f"driver: unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    return results


def _recommend(entry: dict[str, Any], profile: dict[str, Any], prompt_len: float) -> int | None:
    from benchmarks.profile_forward import recommend_block_size

    acceptance = entry["acceptance_per_position"]
    if not acceptance:
        return None
    contexts = sorted(int(c) for c in profile["latency_s"])
    ctx = min(contexts, key=lambda c: abs(c - prompt_len))
    latency = {int(q): t for q, t in profile["latency_s"][str(ctx)].items()}
    return recommend_block_size(acceptance, latency, entry["forwards_per_step"])


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """PNG plots when matplotlib is installed: tokens/s vs concurrency, acceptance length
    per category. Returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for e in report["results"]:
        xs = sorted(int(c) for c in e["system_tokens_per_s"])
        ax.plot(xs, [e["system_tokens_per_s"][str(c)] for c in xs], marker="o",
                label=f"{e['engine']}/{e['baseline']}")
    ax.set(xlabel="concurrency", ylabel="system tokens/s", title="tokens/s vs concurrency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=80)
    written.append("tokens_per_s.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    spec = [e for e in report["results"] if e["overall"]["acceptance_length"] is not None]
    categories = list(dict.fromkeys(c for e in spec for c in e["per_category"]))
    width = 0.8 / max(1, len(spec))
    for i, e in enumerate(spec):
        ax.bar([j + i * width for j in range(len(categories))],
               [e["per_category"][c]["acceptance_length"] or 0 for c in categories], width,
               label=f"{e['engine']}/{e['baseline']}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories,
                  rotation=30, fontsize=7)
    ax.set(ylabel="acceptance length", title="acceptance length per category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_category.png", dpi=80)
    written.append("acceptance_by_category.png")
    plt.close("all")
    return written


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# Benchmark: {meta['dataset']} ({meta['num_prompts']} prompts), {meta['model']}",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']['nproc']} CPUs, {meta['machine']['cpu']}",
        f"- date: {meta['date']}",
        (f"- max tokens {meta['max_tokens']}, drafts per step {meta['num_draft_tokens']}, "
        f"greedy, ignore EOS: {meta['ignore_eos']}; prompts cut to fit: {meta['prompts_cut']}"),
        "",
        markdown_table(report["results"]),
        "",
        "Acceptance length per category (lossless rate in brackets):",
        "",
        category_table(report["results"]),
        "",
        "Launch configurations:",
        "",
    ]
    for e in report["results"]:
        lines.append(f"- {e['engine']}/{e['baseline']}: `{json.dumps(e['launch'])}`"
                     + (f"; recommended block size {e['recommended_block_size']}"
                        if e.get("recommended_block_size") else ""))
        lines += [f"  - {n}" for n in e["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    model = args.model or _default_model()
    try:
        prompts = load_prompts(args.dataset, args.data_path, args.num_prompts, args.categories)
    except ValueError as e:
        raise SystemExit(f"driver: {e}") from None
    budget = args.max_model_len - args.max_tokens
    ids, cut = tokenize(prompts, model, args.chat, budget)
    runs = run_engines(args, model, ids)
    categories = [p.category for p in prompts]
    ar = {r.engine: r for r in runs if r.baseline == "ar"}
    entries = [summarize(r, categories, ar.get(r.engine)) for r in runs]
    if args.profile:
        profile = json.loads(args.profile.read_text())
        mean_len = sum(map(len, ids)) / len(ids)
        for e in entries:
            e["recommended_block_size"] = _recommend(e, profile, mean_len)
    argv_list = argv if argv is not None else sys.argv[1:]
    report = {
        "meta": {
            "command": "python benchmarks/driver.py " + " ".join(argv_list),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "model": model, "dataset": args.dataset, "data_path": args.data_path,
            "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "num_draft_tokens": args.num_draft_tokens, "concurrency": args.concurrency,
            "ignore_eos": args.ignore_eos,
            "prompts_cut": cut, "git_commit": _git_commit(),
        },
        "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(t)}
                    for p, t in zip(prompts, ids)],
        "results": entries,
    }
    markdown = render_markdown(report)
    print(markdown)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        (args.out / "report.md").write_text(markdown)
        report["plots"] = plot(report, args.out)
    return report


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
