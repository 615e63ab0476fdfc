"""The benchmark driver: one prompt set, every baseline on every engine, one report.

Each engine has one adapter (``benchmarks/adapters``); every figure comes from the shared
metrics (``benchmarks/metrics.py``), and every speed row carries its lossless column: the
fraction of prompts whose greedy output equals the same engine's AR output. A method that is
not lossless (Fast-dLLM) is compared on an engine with the reference decoder's output of the
same method instead (its oracle; ``compared_with`` in the report), and a diffusion-only
checkpoint (LLaDA, Dream, Fast-dLLM v2: no AR view) runs no AR row.

    python -m benchmarks driver --dataset gsm8k --num-prompts 8 \\
        --engines reference,vllm,sglang --sglang-python SGLANG_VENV/bin/python \\
        --baselines ar,ngram:4,eagle3:3,orthrus --eagle3-drafter DRAFTER --out results/run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import baselines as baseline_specs
from benchmarks import command_line, tiny_drafters, verb_parser
from benchmarks.adapters import vllm_offline
from benchmarks.adapters.sglang_offline import METHODS as SGLANG_METHODS
from benchmarks.adapters.sglang_offline import add_sglang_args, sglang_runtime
from benchmarks.baselines import METHODS, Baseline
from benchmarks.datasets import DATASETS, DEFAULT_PATHS, SPEED_BENCH_SUBSETS, Prompt, load_prompts
from benchmarks.metrics import RunResult, category_table, markdown_table, summarize
from benchmarks.plots import pyplot, save
from diffspec.methods import METHODS as REGISTRY
from diffspec.methods import reference_methods_for
from diffspec.plugin.sglang.dllm import fast_dllm_options

ENGINES = ("reference", "vllm", "sglang", "openai")
REFERENCE_METHODS = baseline_specs.engine_methods("reference")


def _default_model() -> str:
    from diffspec.assets import ASSETS_DIR

    return str(ASSETS_DIR / REGISTRY["orthrus"].bundled)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    methods = "\n".join(f"  {name:<17}{what}" for name, what in METHODS.items())
    p = verb_parser(
        "driver",
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        epilog=(
            "engines (each runs the baselines it supports, AR first):\n"
            "  reference  diffspec's reference decoder, in-process, concurrency 1 only;\n"
            f"             {', '.join(REFERENCE_METHODS)}\n"
            "  vllm       vllm.LLM in a subprocess of this interpreter, counters from\n"
            f"             llm.get_metrics(); {', '.join(vllm_offline.METHODS)}\n"
            "  sglang     sglang.Engine in a subprocess of --sglang-python, counters from each\n"
            f"             request's meta_info; {', '.join(SGLANG_METHODS)}\n"
            "  openai     an already running OpenAI-compatible server on loopback (vLLM or\n"
            "             SGLang, --openai-engine); the lossless column needs --openai-ar-url\n\n"
            f"baselines (METHOD[:K], K drafts per step):\n{methods}\n\n"
            "metrics: acceptance length = 1 + accepted drafts / verify steps (engine counters);\n"
            "TPF = tokens / target forwards after prefill (self-spec step = draft + verify = 2);\n"
            "tok/s/user at concurrency 1; system tok/s at each --concurrency; TTFT / TPOT\n"
            "where the engine exposes them; lossless = exact-match rate vs the engine's AR\n"
            "(a method that is not lossless, e.g. fast_dllm: vs the reference decoder's run).\n"
            "A baseline whose engine fails is reported as a failed row with its error."
        ),
    )
    p.add_argument("--model", default=None,
                   help="local checkpoint (default: the bundled synth-orthrus)")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k",
                   help="gsm8k / humaneval (shared data), speed-bench (a local copy: a folder "
                   "with {subset}.jsonl, or one JSONL / JSON file), jsonl ({\"prompt\": ...} rows)")
    p.add_argument("--data-path", default=None, help="dataset file; default for gsm8k: "
                   f"{DEFAULT_PATHS['gsm8k']}, humaneval: {DEFAULT_PATHS['humaneval']}")
    p.add_argument("--speed-bench-subset", default="qualitative", choices=SPEED_BENCH_SUBSETS,
                   help="SPEED-Bench split when --data-path is a folder (default: qualitative)")
    p.add_argument("--categories", type=_csv, default=None,
                   help="keep only these categories (comma-separated)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts to run (SPEED-Bench: spread over categories)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512,
                   help="context length; prompts are cut (their last tokens kept) to fit")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens for every prompt (no stop on EOS)")
    p.add_argument("--dtype", default="float32",
                   help="engine dtype (default float32: the dtype in which greedy outputs of "
                   "AR and speculative runs match exactly; bfloat16 for GPU timings)")
    p.add_argument("--fast-dllm-attention", choices=("trained", "block_causal"),
                   default="trained",
                   help="reference decoder's fast_dllm layout: the family's trained one, or "
                   "block_causal (SGLang's dLLM layout: compare it with --engines sglang)")
    p.add_argument("--fast-dllm-config", default=None, metavar="YAML",
                   help="fast_dllm settings (threshold, block_size, sub_block_size, cache: "
                   "prefix | dual), given to SGLang as --dllm-algorithm-config and to the "
                   "reference decoder as its options, so both decode with the same ones "
                   "(default: the method's defaults)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of the reference decoder (default 1)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--engines", type=_csv, default=["reference"],
                   help=f"comma-separated from {', '.join(ENGINES)} (default: reference)")
    p.add_argument("--baselines", type=_csv, default=None,
                   help="comma-separated METHOD[:K] (AR always runs: it is the lossless oracle;"
                   " default: every lossless method whose reference decoder serves the model)")
    p.add_argument("--num-draft-tokens", type=int, default=31,
                   help="default drafts per step K of every speculative baseline (default 31)")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in _csv(t)], default=[1, 2, 4],
                   help="system tokens/s at these concurrencies (default 1,2,4)")
    baseline_specs.add_drafter_args(p)
    p.add_argument("--vllm-args", type=json.loads, default={},
                   help="JSON object of vllm.LLM arguments over the defaults (e.g. "
                   "'{\"enforce_eager\": false, \"gpu_memory_utilization\": 0.9}' on a GPU)")
    p.add_argument("--sglang-args", type=json.loads, default={},
                   help="JSON object of sglang.Engine arguments over the defaults")
    add_sglang_args(p)
    p.add_argument("--openai-url", default=None, help="loopback server running the method")
    p.add_argument("--openai-ar-url", default=None, help="loopback server running plain AR")
    p.add_argument("--openai-model", default=None, help="served model name (default: --model)")
    p.add_argument("--openai-baseline", default="method",
                   help="name of the --openai-url server's configuration in the report")
    p.add_argument("--openai-engine", choices=("vllm", "sglang"), default="vllm",
                   help="what serves --openai-url: where its acceptance counters are read "
                   "(vLLM: /metrics; SGLang: /server_info)")
    p.add_argument("--openai-launch", default=None,
                   help="the command that started the --openai-url server (recorded)")
    p.add_argument("--profile", type=Path, default=None,
                   help="forward_latency.json of profile_forward.py: add the recommended "
                   "block size per baseline")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for report.json / report.md / PNG plots")
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


def _sglang_setup(args: argparse.Namespace) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The SGLang interpreter, the environment added for its worker and extra engine
    arguments (:func:`benchmarks.adapters.sglang_offline.sglang_runtime`; the harness's
    KV pool 8192 tokens)."""
    python, full, extra = sglang_runtime(args)
    env = {k: v for k, v in full.items() if os.environ.get(k) != v}
    return python, env, ({**extra, "max_total_tokens": 8192} if args.sglang_cpu_harness else extra)


ENGINE_METHODS = {"reference": REFERENCE_METHODS, "vllm": vllm_offline.METHODS,
                  "sglang": SGLANG_METHODS}


def skipped(engines: list[str], baselines: list[Baseline]) -> list[str]:
    """``engine/baseline`` pairs not run because the engine has no such method."""
    return [f"{e}/{b.label}" for e in engines if e in ENGINE_METHODS
            for b in baselines if b.method not in ENGINE_METHODS[e]]


def run_engines(args: argparse.Namespace, model: str, ids: list[list[int]],
                baselines: list[Baseline]) -> list[RunResult]:
    """Every (engine, baseline) run; AR first on each engine."""
    results: list[RunResult] = []
    for engine in args.engines:
        if engine == "reference":
            from benchmarks.adapters import reference

            for b in baselines:
                if b.method in REFERENCE_METHODS:
                    print(f"[reference] {b.label} ...", file=sys.stderr, flush=True)
                    options = ({"attention": args.fast_dllm_attention,
                                **args.fast_dllm_options}
                               if b.method == "fast_dllm" else None)
                    results.append(reference.run(b, model, ids, args.max_tokens,
                                                 args.ignore_eos, args.threads, options))
        elif engine == "vllm":
            chosen = [b for b in baselines if b.method in vllm_offline.METHODS]
            print(f"[vllm] {', '.join(b.label for b in chosen)} ...", file=sys.stderr, flush=True)
            results += vllm_offline.run(chosen, model, ids, args.max_tokens, args.concurrency,
                                        args.max_model_len, ignore_eos=args.ignore_eos,
                                        dtype=args.dtype, extra_kwargs=args.vllm_args)
        elif engine == "sglang":
            from benchmarks.adapters import sglang_offline

            python, env, extra = _sglang_setup(args)
            chosen = [b for b in baselines if b.method in SGLANG_METHODS]
            print(f"[sglang] {', '.join(b.label for b in chosen)} ...", file=sys.stderr,
                  flush=True)
            results += sglang_offline.run(chosen, model, ids, args.max_tokens, args.concurrency,
                                          args.max_model_len, python=python, env=env,
                                          ignore_eos=args.ignore_eos, dtype=args.dtype,
                                          extra_kwargs={**extra, **args.sglang_args})
        elif engine == "openai":
            from benchmarks.adapters import openai_server

            if not args.openai_url:
                raise SystemExit("driver: --engines openai needs --openai-url")
            served = args.openai_model or model
            if args.openai_ar_url:
                results.append(openai_server.run("ar", args.openai_ar_url, served, ids,
                                                 args.max_tokens, args.concurrency,
                                                 server=args.openai_engine))
            launch = {"command": args.openai_launch} if args.openai_launch else None
            results.append(openai_server.run(args.openai_baseline, args.openai_url, served, ids,
                                             args.max_tokens, args.concurrency, launch,
                                             server=args.openai_engine))
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


def _name(entry: dict[str, Any]) -> str:
    return (f"{entry['engine']}/{entry['baseline']}"
            + (" (untrained drafter)" if entry.get("untrained_drafter") else ""))


def _caption(meta: dict[str, Any]) -> str:
    """What every figure carries: the command, the machine and the date that made it."""
    m = meta["machine"]
    return "\n".join(textwrap.wrap(f"command: {meta['command']}", 150)
                     + [f"machine: {m['cpu']}, {m['nproc']} CPUs; date: {meta['date']}"])


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """PNG plots (when matplotlib is installed): system tokens/s vs concurrency, acceptance
    length per category; each names its command, machine and date. Returns the files."""
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return []
    ok = [e for e in report["results"] if not e.get("error")]
    caption = _caption(report["meta"])
    written = []
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for e in ok:
        xs = sorted(int(c) for c in e["system_tokens_per_s"])
        ax.plot(xs, [e["system_tokens_per_s"][str(c)] for c in xs], marker="o", label=_name(e))
    ax.set_xticks(sorted({int(c) for e in ok for c in e["system_tokens_per_s"]}) or [1])
    ax.set(xlabel="concurrency", ylabel="system tokens/s", title="tokens/s vs concurrency")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom")
    save(fig, out / "tokens_per_s.png", dpi=100, rect=(0, 0.08, 1, 1))
    written.append("tokens_per_s.png")
    fig, ax = plt.subplots(figsize=(9, 4.6))
    spec = [e for e in ok if e["overall"]["acceptance_length"] is not None]
    categories = list(dict.fromkeys(c for e in spec for c in e["per_category"]))
    width = 0.8 / max(1, len(spec))
    for i, e in enumerate(spec):
        ax.bar([j + i * width for j in range(len(categories))],
               [e["per_category"][c]["acceptance_length"] or 0 for c in categories], width,
               label=_name(e))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories,
                  rotation=30, fontsize=7)
    ax.set(ylabel="acceptance length", title="acceptance length per category")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom")
    save(fig, out / "acceptance_by_category.png", dpi=100, rect=(0, 0.08, 1, 1))
    written.append("acceptance_by_category.png")
    return written


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# Benchmark: {meta['dataset']} ({meta['num_prompts']} prompts), {meta['model']}",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']['nproc']} CPUs, {meta['machine']['cpu']}",
        f"- date: {meta['date']}",
        *([f"- not run (the engine has no such method): {', '.join(meta['not_run'])}"]
          if meta.get("not_run") else []),
        (f"- max tokens {meta['max_tokens']}, default drafts per step "
         f"{meta['num_draft_tokens']}, greedy, {meta['dtype']}, ignore EOS: "
         f"{meta['ignore_eos']}; prompts cut to fit: {meta['prompts_cut']}"),
        "",
        markdown_table(report["results"]),
        "",
        *[f"- lossless column of {_name(e)}: output == {e['compared_with']}'s" for e in
          report["results"] if e.get("compared_with")
          and e["compared_with"] != f"{e['engine']}/ar"],
        "",
        "Acceptance length per category (lossless rate in brackets):",
        "",
        category_table(report["results"]),
        "",
    ]
    if report.get("plots"):
        lines += ["Plots: " + ", ".join(f"`{f}`" for f in report["plots"]), ""]
    lines += ["Launch configurations (exact):", ""]
    for e in report["results"]:
        launch = dict(e["launch"])
        command = launch.pop("vllm serve", None) or launch.pop("sglang serve", None)
        lines.append(f"- {_name(e)}: `{json.dumps(launch)}`"
                     + (f"; recommended block size {e['recommended_block_size']}"
                        if e.get("recommended_block_size") else ""))
        if command:
            lines.append(f"  - as a server: `{command}`")
        if e.get("error"):
            lines.append("  - **failed**: " + e["error"].replace("\n", " / "))
        lines += [f"  - {n}" for n in e["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    model = args.model or _default_model()
    try:
        prompts = load_prompts(args.dataset, args.data_path, args.num_prompts, args.categories,
                               args.speed_bench_subset)
        drafters = baseline_specs.drafters_from_args(args)
        if args.baselines is None:
            from diffspec.core.checkpoint import inspect_checkpoint

            args.baselines = [m.name for m in reference_methods_for(
                inspect_checkpoint(model).family) if m.lossless]
        specs = args.baselines + [m for m, d in drafters.items()
                                  if d and not any(s.partition(":")[0] == m
                                                   for s in args.baselines)]
        baselines = baseline_specs.parse(specs, args.num_draft_tokens, drafters)
        # read (and checked) before any engine starts
        args.fast_dllm_options = fast_dllm_options(args.fast_dllm_config)
        if args.fast_dllm_config:
            baselines = [replace(b, dllm_config=args.fast_dllm_config)
                         if b.method == "fast_dllm" else b for b in baselines]
    except ValueError as e:
        raise SystemExit(f"driver: {e}") from None
    no_ar = _without_ar_view(model)
    if no_ar:
        baselines = [b for b in baselines if b.method != "ar"]
    if ({"reference", "sglang"} <= set(args.engines) and args.fast_dllm_attention == "trained"
            and any(b.method == "fast_dllm" for b in baselines)):
        print("driver: warning: SGLang's FastDLLM runs the block_causal layout; its output "
              "equals the reference decoder's only with --fast-dllm-attention block_causal",
              file=sys.stderr)
    budget = args.max_model_len - args.max_tokens
    ids, cut = tokenize(prompts, model, args.chat, budget)
    runs = run_engines(args, model, ids, baselines)
    categories = [p.category for p in prompts]
    entries = []
    for r in runs:
        oracle = _oracle(r, runs)
        entries.append(summarize(r, categories, oracle))
        entries[-1]["compared_with"] = (f"{oracle.engine}/{oracle.baseline}"
                                        if oracle is not None else None)
    untrained = {b.label for b in baselines if tiny_drafters.is_untrained(b.drafter)}
    for e in entries:
        e["untrained_drafter"] = e["baseline"] in untrained
    if args.profile:
        profile = json.loads(args.profile.read_text())
        mean_len = sum(map(len, ids)) / len(ids)
        for e in entries:
            e["recommended_block_size"] = _recommend(e, profile, mean_len)
    command = (command_line("driver", argv) if argv is not None
               else shlex.join(["python", *sys.orig_argv[1:]]))  # as it was typed
    report: dict[str, Any] = {
        "meta": {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "model": model, "dataset": args.dataset, "data_path": args.data_path,
            "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "num_draft_tokens": args.num_draft_tokens, "concurrency": args.concurrency,
            "ignore_eos": args.ignore_eos, "dtype": args.dtype,
            "baselines": [b.__dict__ for b in baselines],
            "not_run": skipped(args.engines, baselines) + (
                [f"*/ar ({no_ar})"] if no_ar else []),
            "prompts_cut": cut, "git_commit": _git_commit(),
        },
        "prompts": [{"id": p.id, "category": p.category, "prompt_tokens": len(t)}
                    for p, t in zip(prompts, ids)],
        "results": entries,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report["plots"] = plot(report, args.out)
    markdown = render_markdown(report)
    print(markdown)
    if args.out:
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
        (args.out / "report.md").write_text(markdown)
    return report


def _without_ar_view(model: str) -> str | None:
    """Why ``model`` runs no AR baseline (a diffusion-only family), or ``None``."""
    from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
    from diffspec.methods import FAMILIES

    try:
        family = FAMILIES.get(str(inspect_checkpoint(model).family))
    except CheckpointError:
        return None
    if family is None or family.causal:
        return None
    return f"family {family.name} has no AR view"


def _oracle(run: RunResult, runs: list[RunResult]) -> RunResult | None:
    """What ``run``'s lossless column compares with: the same engine's AR run; for a method
    that is not lossless on an engine, the reference decoder's run of that method (its
    oracle); ``None`` when there is neither."""
    method = REGISTRY.get(run.baseline.partition(":")[0])
    if method is not None and not method.lossless and run.engine != "reference":
        return next((r for r in runs if r.engine == "reference"
                     and r.baseline == run.baseline), None)
    return next((r for r in runs if r.engine == run.engine and r.baseline == "ar"), None)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
