"""Step time against context length: plain AR and fixed-K self-speculation, in vLLM and
SGLang, in one run.

    python -m benchmarks step-vs-context --engines vllm,sglang --sglang-cpu-harness \\
        --dataset jsonl --data-path heldout.jsonl --contexts 256,512,1024,2048,4096 \\
        --out DIR

Per engine, two engine starts (plain AR, then ``METHOD:K``), each serving one request at
a time whose prompt is the last ``L`` tokens of one long text (the dataset's prompts
joined), for every ``L`` of ``--contexts``. A step's time is
``(t(long) - t(short)) / (steps(long) - steps(short))``: the prefill and the call's fixed
costs cancel, steps are the engine's verify steps (its spec-decode counters). The drafter
times its own draft passes (``$DIFFSPEC_DRAFT_TIMINGS``; SGLang's also its verify
forward), so the table shows the draft pass apart from the whole step.

What it is for: a drafter that copies or re-reads the whole prefix outside the engine's
attention kernel grows faster with context than the engine's own decode step does; the
``spec / AR`` column shows how the speculative step's cost grows relative to AR's.

Writes ``DIR/context.json``, ``DIR/context.md`` and ``DIR/context.png``; ``--render``
redraws them from a finished run's JSON. Speed comes from this table, never from tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser
from benchmarks.adaptive_sweep import ENGINES, _ints, add_run_args, engine_launch, run_worker
from benchmarks.adapters.sglang_offline import add_sglang_args
from benchmarks.baselines import Baseline, parse
from benchmarks.datasets import DATASETS, load_prompts
from benchmarks.driver import _sglang_setup, machine
from benchmarks.plots import pyplot, save

DRAFT_TIMINGS_ENV = "DIFFSPEC_DRAFT_TIMINGS"  # diffspec.profiling.DRAFT_TIMINGS_ENV


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("step-vs-context", __doc__)
    add_run_args(p, "K drafts per step")
    p.add_argument("--dataset", choices=DATASETS, default="jsonl")
    p.add_argument("--data-path", default=None)
    p.add_argument("--num-prompts", type=int, default=200,
                   help="prompts joined into the long text (enough for the longest context)")
    p.add_argument("--contexts", default="256,512,1024,2048,4096")
    p.add_argument("--short", type=int, default=4, help="tokens of the short call")
    p.add_argument("--long", type=int, default=20, help="tokens of the long call")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per length (least)")
    add_sglang_args(p)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine start")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--render", action="store_true", help="redraw from DIR/context.json")
    return p


def long_prompt(args: argparse.Namespace, need: int) -> list[int]:
    """The dataset's prompts joined into one text, as token ids (at least ``need``)."""
    from transformers import AutoTokenizer

    texts = [p.text for p in load_prompts(args.dataset, args.data_path, args.num_prompts)]
    ids = AutoTokenizer.from_pretrained(args.model)("\n\n".join(texts),
                                                    add_special_tokens=False)["input_ids"]
    if len(ids) < need:
        raise SystemExit(f"step-vs-context: raise --num-prompts: the joined prompts give "
                         f"{len(ids)} tokens, the longest context needs {need}")
    return ids


def rows_of(engine: str, runs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per context: AR step, spec step, draft / verify pass, spec / AR."""
    ar = {r["context"]: r for r in runs["ar"].get("context", [])}
    rows = []
    for r in runs["spec"].get("context", []):
        base = ar.get(r["context"])
        rows.append({"engine": engine, "context": r["context"],
                     "ar_step_ms": base and base["step_s"] * 1e3,
                     "spec_step_ms": r["step_s"] * 1e3,
                     "draft_ms": r["draft_s"] and r["draft_s"] * 1e3,
                     "verify_ms": r["verify_s"] and r["verify_s"] * 1e3,
                     "spec_over_ar": base and r["step_s"] / base["step_s"]})
    return rows


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = [f"`{meta['command']}`", "", f"{meta['date']}; {meta['machine']}; {meta['note']}",
             ""]
    for engine, result in data["engines"].items():
        lines += [f"### {engine}", ""]
        if "error" in result:
            lines += [f"error: {result['error'][:300]}", ""]
            continue
        first = result["rows"][0] if result["rows"] else None
        lines += [("| context | AR step ms | spec step ms | draft pass ms | verify pass ms | "
                   "spec / AR | spec / AR vs shortest |"), "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            growth = (r["spec_over_ar"] / first["spec_over_ar"]
                      if first and first["spec_over_ar"] and r["spec_over_ar"] else None)
            lines.append(f"| {r['context']} | {_num(r['ar_step_ms'])} | "
                         f"{_num(r['spec_step_ms'])} | {_num(r['draft_ms'])} | "
                         f"{_num(r['verify_ms'])} | {_num(r['spec_over_ar'], 2)} | "
                         f"{_num(growth, 2)} |")
        lines.append("")
    return "\n".join(lines)


def plot(data: dict[str, Any], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return None
    engines = [e for e, r in data["engines"].items() if "error" not in r]
    if not engines:
        return None
    fig, axes = plt.subplots(1, len(engines), figsize=(6 * len(engines), 4), squeeze=False)
    for ax, engine in zip(axes[0], engines):
        rows = data["engines"][engine]["rows"]
        xs = [r["context"] for r in rows]
        for key, label in (("ar_step_ms", "AR step"), ("spec_step_ms", "spec step"),
                           ("draft_ms", "draft pass")):
            ys = [r[key] for r in rows]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms")
        ax.set_title(engine)
        ax.legend()
    return save(fig, out / "context.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        data = json.loads((args.out / "context.json").read_text())
        (args.out / "context.md").write_text(render(data) + "\n")
        plot(data, args.out)
        print(render(data))
        return 0
    engines = [e for e in args.engines.split(",") if e]
    if unknown := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"step-vs-context: use --engines from {', '.join(ENGINES)} "
                         f"(unknown: {', '.join(unknown)})")
    if args.model is None:
        from diffspec.default_model import prepare_default

        args.model = str(prepare_default())
    contexts = _ints(args.contexts)
    ids = long_prompt(args, max(contexts))
    args.max_model_len = max(contexts) + args.long + 2 * (args.num_draft_tokens + 1) + 16
    args.out.mkdir(parents=True, exist_ok=True)
    [_, fixed] = parse([f"{args.method}:{args.num_draft_tokens}"], args.num_draft_tokens)
    job = {"model": args.model, "mode": "context", "prompts": [ids[-min(contexts):]],
           "long_prompt": ids[-max(contexts):], "contexts": contexts, "short": args.short,
           "long": args.long, "step_repeats": args.repeats}
    results: dict[str, Any] = {}
    for engine in engines:
        if engine == "sglang":
            python, env, extra = _sglang_setup(args)
            extra = {**extra, "max_total_tokens": max(16384, 2 * args.max_model_len)}
        else:
            python, env, extra = sys.executable, {"VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", "2")}, {}
        runs, launches = {}, {}
        for name, b in (("ar", Baseline("ar", "ar", 0)), ("spec", fixed)):
            launch = launches[name] = engine_launch(engine, b, None, args, extra)
            with tempfile.TemporaryDirectory() as tmp:
                timings = Path(tmp) / "timings.txt"
                runs[name] = run_worker(engine, name, launch, job, python,
                                        {**env, DRAFT_TIMINGS_ENV: str(timings)},
                                        args.out / f"{engine}-{name}.log", args.timeout)
        error = next((r["error"] for r in runs.values() if "error" in r), None)
        results[engine] = ({"error": error} if error else
                           {"launch": launches, "runs": runs, "rows": rows_of(engine, runs)})
    data = {"meta": {"command": command_line("step-vs-context", argv),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "machine": machine(),
                     "note": f"one request at a time, greedy, fp32, EOS ignored; {fixed.label}; "
                             f"step = (t({args.long}) - t({args.short})) / (steps difference), "
                             f"least of {args.repeats} calls"},
            "engines": results}
    (args.out / "context.json").write_text(json.dumps(data) + "\n")
    (args.out / "context.md").write_text(render(data) + "\n")
    png = plot(data, args.out)
    print(render(data))
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
