"""Adaptive draft counts under load: system tokens/s of plain AR, fixed-K and adaptive
self-speculation over a concurrency sweep, in vLLM and SGLang, with repeats.

    python -m benchmarks sweep --engines vllm,sglang --sglang-cpu-harness \\
        --dataset jsonl --data-path heldout.jsonl --num-draft-tokens 3 \\
        --concurrency 1,2,4,8,16,32 --repeats 3 --max-tokens 64 --out DIR

Per engine, on the model (default: the embedded default, SmolLM2-135M-Instruct + Orthrus):

1. **Latency profile** (unless ``--latency-profile ENGINE=PATH``): the engine's own decode
   step time with ``B`` requests in flight (plain AR on the same checkpoint, ``B`` = 1 ..
   ``--profile-batch-sizes``; ``sweep.step_times``), and its draft pass time by query tokens
   (a fixed-K engine with ``$DIFFSPEC_DRAFT_TIMINGS`` set, so the drafter times its own
   passes, serving ``B`` = each ``--concurrency``; SGLang's also times its verify forward).
   ``--method tidar``: its one quadratic step, which the policy prices by the requests in
   it and their drafts (``step_grid``: the drafter's timing of whole steps in which every
   request verifies and pre-drafts ``k``, from one step's forward to the next), measured
   at several fixed K (``--profile-draft-counts``, default 1, K/2 and K) and at every
   batch size it serves (each ``--concurrency`` and each ``--profile-batch-sizes`` up to
   the largest concurrency: a wave's batch shrinks as its requests finish; rows of batch
   sizes measured at every K), each serving ``--max-tokens`` per request twice; the
   drafter's own timing of the forward, accept and next drafts goes to ``verify_points``
   (by the step's query tokens, what older profiles priced TiDAR by). Written to
   ``DIR/ENGINE-latency-profile.json`` as ``{"points", "draft_points", "verify_points"[,
   "step_grid"]}``, the file the adaptive policy loads.
2. **Sweep**: for every repeat, one engine start per baseline in turn (``ar``, ``METHOD:K``,
   ``METHOD:K adaptive``, then the next repeat: drift of a shared machine falls on all of
   them), each serving, for every concurrency ``c``, ``max(--min-prompts, 2c)`` prompts in waves of ``c``
   (greedy, ``--max-tokens`` each, EOS ignored so every baseline generates the same tokens).

Writes ``DIR/sweep.json`` (every repeat), ``DIR/sweep.md`` (median tokens/s, min-max spread,
ratio to AR, lossless = outputs equal to AR's, draft tokens per output token from the
engine's spec-decode counters) and ``DIR/sweep.png``. Speed comes from this table, never
from tests; the machine and date are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser
from benchmarks.adapters import sglang_offline, vllm_offline
from benchmarks.adapters.sglang_offline import add_sglang_args
from benchmarks.adapters.sweep import RESULT_PREFIX
from benchmarks.baselines import Baseline, parse
from benchmarks.datasets import DATASETS, load_prompts
from benchmarks.driver import _sglang_setup, machine, tokenize
from benchmarks.plots import pyplot, save

ENGINES = ("vllm", "sglang")
ADAPTIVE = " adaptive"  # label suffix of the adaptive baseline


def add_run_args(p: argparse.ArgumentParser, k_help: str) -> None:
    """What a self-speculation run measures on: the engines, the checkpoint, the method and
    its K (this sweep and ``step_vs_context``)."""
    p.add_argument("--engines", default="vllm", help="comma list of: vllm, sglang")
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded default, "
                   "prepared as `diffspec quickstart` does)")
    p.add_argument("--method", default="orthrus", help="self-speculative method (registry)")
    p.add_argument("--num-draft-tokens", type=int, default=3, help=k_help)


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("sweep", __doc__)
    add_run_args(p, "K of the fixed baseline and the adaptive one's most drafts per step")
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k")
    p.add_argument("--data-path", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--prompt-budget", type=int, default=256, help="prompts cut to their last "
                   "N tokens")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-prompts", type=int, default=8, help="prompts served at least per "
                   "concurrency (c=1 serves them one by one: more is less noise)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--profile-batch-sizes", default="1,2,4,8,16,32,64,128")
    p.add_argument("--profile-draft-counts", default=None, help="fixed draft counts whose "
                   "passes the profile times (default: --num-draft-tokens; for a method with "
                   "one forward per step, tidar, also 1 and half of it)")
    p.add_argument("--latency-profile", action="append", default=[], metavar="ENGINE=PATH",
                   help="use this profile for ENGINE instead of measuring one")
    add_sglang_args(p)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine run")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile-only", action="store_true", help="only measure each engine's "
                   "latency profile (OUT/ENGINE-latency-profile.json, what \"latency_profile\" "
                   "of the adaptive policy reads) and stop")
    p.add_argument("--render", action="store_true", help="only write sweep.md / sweep.png "
                   "again from OUT/sweep.json")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def engine_launch(engine: str, b: Baseline, adaptive_profile: Path | None,
                  args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` / ``sglang.Engine`` keyword arguments of a baseline (the driver's, plus
    the adaptive options)."""
    if engine == "vllm":
        kwargs = vllm_offline.llm_kwargs(b, args.max_model_len)
        if adaptive_profile is not None:
            kwargs["speculative_config"] |= {"adaptive": True,
                                             "latency_profile": str(adaptive_profile)}
        return kwargs
    kwargs = sglang_offline.engine_kwargs(b, args.max_model_len, "float32", extra)
    if adaptive_profile is not None:
        kwargs["json_model_override_args"] = json.dumps(
            {"diffspec": {"adaptive": True, "latency_profile": str(adaptive_profile)}})
    return kwargs


def run_worker(engine: str, name: str, launch: dict[str, Any], job: dict[str, Any],
               python: str, env: dict[str, str], log: Path, timeout: int,
               tag: str = "adaptive-sweep") -> dict[str, Any]:
    """One engine start in a worker subprocess; its run's result (or ``{"error"}``)."""
    worker = {"vllm": vllm_offline.WORKER, "sglang": sglang_offline.WORKER}[engine]
    key = "llm" if engine == "vllm" else "engine"
    full = {**job, "runs": [{"name": name, key: launch}]}
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(full))
        print(f"[{tag}] {engine} / {name} ...", file=sys.stderr, flush=True)
        with log.open("w") as err:
            proc = subprocess.run([python, str(worker), str(job_file)], stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout, check=False, env={**os.environ, **env})
    prefix = RESULT_PREFIX
    lines = [l for l in proc.stdout.splitlines() if l.startswith(prefix)]
    with log.open("a") as out:  # the engine's own log lines (vLLM logs to stdout)
        out.writelines(l + "\n" for l in proc.stdout.splitlines() if not l.startswith(prefix))
    if not lines:
        return {"error": f"worker exited with {proc.returncode}; log: {log}"}
    return json.loads(lines[-1][len(prefix):])["runs"][name]


def measure_profile(engine: str, b: Baseline, ids: list[list[int]], args: argparse.Namespace,
                    python: str, env: dict[str, str], extra: dict[str, Any]) -> Path:
    """The engine's latency profile (see the module docstring): ``{"points": AR step
    seconds by requests in flight, "draft_points" / "verify_points": the drafter's pass
    seconds by query tokens, "step_grid": quadratic step seconds by requests and drafts
    (TiDAR only)}``."""
    from diffspec.profiling import DRAFT_TIMINGS_ENV, read_draft_timings, read_step_grid

    out = args.out / f"{engine}-latency-profile.json"
    sizes = _ints(args.profile_batch_sizes)
    ar = Baseline("ar", "ar", 0)
    job = {"model": args.model, "mode": "steps", "prompts": ids, "batch_sizes": sizes}
    steps = run_worker(engine, "profile-ar", engine_launch(engine, ar, None, args, extra), job,
                       python, env, args.out / f"{engine}-profile-ar.log", args.timeout)
    if "error" in steps:
        raise SystemExit(f"adaptive-sweep: {engine} AR profile failed: {steps['error']}")
    timings = args.out / f"{engine}-draft-timings.txt"
    timings.unlink(missing_ok=True)
    draft_job = {**job, "batch_sizes": profile_draft_batch_sizes(b, args), "step_repeats": 1}
    if b.forwards_per_step == 1:  # steady steps of every batch size, timed whole (step_grid)
        draft_job |= {"long": max(args.max_tokens, 20), "step_repeats": 2}
    counts = profile_draft_counts(b, args.profile_draft_counts)
    for k in counts:
        fixed = Baseline(f"{b.method}:{k}", b.method, k)
        drafts = run_worker(engine, f"profile-draft-{k}",
                            engine_launch(engine, fixed, None, args, extra), draft_job, python,
                            {**env, DRAFT_TIMINGS_ENV: str(timings)},
                            args.out / f"{engine}-profile-draft-k{k}.log", args.timeout)
        if "error" in drafts:
            raise SystemExit(f"adaptive-sweep: {engine} draft profile (K={k}) failed: "
                             f"{drafts['error']}")
    grid = full_rows(read_step_grid(timings), counts)
    profile = {"points": {int(k): v for k, v in steps["step_s"].items()},
               "draft_points": read_draft_timings(timings),
               "verify_points": read_draft_timings(timings, "verify"),
               **({"step_grid": grid} if grid else {}),
               "meta": {"engine": engine, "model": args.model, "method": b.label,
                        "what": "points: seconds per decode step with B requests in flight "
                                "(plain AR); draft_points / verify_points: seconds per "
                                "draft / verify pass by query tokens (the drafter's own "
                                "timings; verify only where the drafter runs it; tidar: "
                                "its quadratic forward, accept and next drafts); "
                                "step_grid (tidar): seconds per whole decode step by "
                                "requests in it and the drafts each verifies and "
                                "pre-drafts, the price of a TiDAR step",
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "machine": machine()}}
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"[adaptive-sweep] {engine} profile -> {out}", file=sys.stderr, flush=True)
    return out


def profile_draft_batch_sizes(b: Baseline, args: argparse.Namespace) -> list[int]:
    """The batch sizes the drafter's passes are timed at: each ``--concurrency``; for a
    method with one forward per step (TiDAR, priced by requests and drafts) also each
    ``--profile-batch-sizes`` up to the largest concurrency (the batch sizes a wave runs
    as its requests finish), so every size served lies between measured ones."""
    concurrency = _ints(args.concurrency)
    if b.forwards_per_step != 1:
        return concurrency
    top = max(concurrency)
    return sorted({*concurrency, *(s for s in _ints(args.profile_batch_sizes) if s <= top)})


def full_rows(grid: dict[int, dict[int, float]],
              counts: list[int]) -> dict[int, dict[int, float]]:
    """The rows of a ``step_grid`` measured at every draft count of ``counts``: a batch
    size met only as a wave's requests finished may lack some, and its row would price
    the missing counts by the measured ones."""
    return {b: row for b, row in grid.items() if row.keys() >= set(counts)}


def profile_draft_counts(b: Baseline, given: str | None) -> list[int]:
    """The fixed draft counts whose passes the profile times: ``given`` (a comma list), else
    ``b``'s; for a method with one forward per step (TiDAR, whose step's tokens grow with
    the square of the drafts) also 1 and half of it, so smaller steps are measured."""
    if given:
        return _ints(given)
    k = b.num_draft_tokens
    return sorted({1, max(k // 2, 1), k}) if b.forwards_per_step == 1 else [k]


def summarize(runs: dict[str, dict[str, Any]], concurrency: list[int]) -> list[dict[str, Any]]:
    """Rows per (baseline, concurrency): median / min / max tokens/s over repeats, ratio
    of medians to AR, lossless share (first repeat's outputs == AR's), draft tokens per
    output token."""
    ar = runs["ar"]
    rows = []
    for label, run in runs.items():
        if "error" in run:
            rows.append({"baseline": label, "error": run["error"]})
            continue
        for c in concurrency:
            reps = [w for w in run["waves"] if w["concurrency"] == c]
            rates = [w["tokens"] / w["seconds"] for w in reps]
            first = next(w for w in reps if w["repeat"] == 0)
            ar_first = next(w for w in ar["waves"] if w["concurrency"] == c and w["repeat"] == 0)
            same = sum(a == b for a, b in zip(first["token_ids"], ar_first["token_ids"],
                                              strict=True))
            ar_median = statistics.median(w["tokens"] / w["seconds"] for w in ar["waves"]
                                          if w["concurrency"] == c)
            tokens = sum(w["tokens"] for w in reps)
            rows.append({
                "baseline": label, "concurrency": c, "repeats": len(rates),
                "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                "x_ar": statistics.median(rates) / ar_median,
                "lossless": same / len(first["token_ids"]),
                "draft_tokens_per_token": sum(w["draft_tokens"] for w in reps) / tokens,
                "accepted_per_token": sum(w["accepted"] for w in reps) / tokens})
    return rows


def drafted(engine: str, row: dict[str, Any]) -> str:
    """Draft tokens per output token from the engine's counters: SGLang counts ``W - 1``
    proposed drafts per verify step whatever the step drafted, so an adaptive row has
    none to show there."""
    if engine == "sglang" and row["baseline"].endswith(ADAPTIVE):
        return "n/a"
    return f"{row['draft_tokens_per_token']:.2f}"


def render(engine_rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> str:
    lines = [f"`{meta['command']}`", "", (f"{meta['date']}; {meta['machine']['cpu']}, "
             f"{meta['machine']['nproc']} cores; {meta['note']}"), ""]
    for engine, rows in engine_rows.items():
        lines += [f"### {engine}", "", ("| baseline | c | tok/s (median) | min-max | x AR | "
                  "lossless | drafted / out tok | accepted / out tok |"),
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['baseline']} | error: {r['error'][:200]} | | | | | |")
                continue
            lines.append(f"| {r['baseline']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
                         f"{r['min']:.1f}-{r['max']:.1f} | {r['x_ar']:.2f} | "
                         f"{r['lossless']:.2f} | {drafted(engine, r)} | "
                         f"{r['accepted_per_token']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(engine_rows: dict[str, list[dict[str, Any]]], out: Path) -> Path | None:
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return None
    fig, axes = plt.subplots(1, len(engine_rows), figsize=(6 * len(engine_rows), 4.5),
                             squeeze=False)
    for ax, (engine, rows) in zip(axes[0], engine_rows.items()):
        for label in dict.fromkeys(r["baseline"] for r in rows if "error" not in r):
            rs = [r for r in rows if r["baseline"] == label and "error" not in r]
            xs = [r["concurrency"] for r in rs]
            ys = [r["tokens_per_s"] for r in rs]
            err = [[y - r["min"] for y, r in zip(ys, rs)], [r["max"] - y for y, r in zip(ys, rs)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency", ylabel="system tokens/s (median, min-max)", title=engine)
        ax.legend()
    return save(fig, out / "sweep.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:  # the table and plot again from a finished run's sweep.json
        data = json.loads((args.out / "sweep.json").read_text())
        engine_rows = {e: r["rows"] for e, r in data["engines"].items()}
        (args.out / "sweep.md").write_text(render(engine_rows, data["meta"]) + "\n")
        plot(engine_rows, args.out)
        print(render(engine_rows, data["meta"]))
        return 0
    engines = [e for e in args.engines.split(",") if e]
    if unknown := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"adaptive-sweep: use --engines from {', '.join(ENGINES)} "
                         f"(unknown: {', '.join(unknown)})")
    given = dict(item.split("=", 1) for item in args.latency_profile)
    if args.model is None:
        from diffspec.default_model import prepare_default

        args.model = str(prepare_default())
    args.out.mkdir(parents=True, exist_ok=True)
    concurrency = _ints(args.concurrency)
    prompts = load_prompts(args.dataset, args.data_path, args.num_prompts)
    ids, _ = tokenize(prompts, args.model, not args.no_chat_template, args.prompt_budget)
    [_, fixed] = parse([f"{args.method}:{args.num_draft_tokens}"], args.num_draft_tokens)
    adaptive = Baseline(fixed.label + ADAPTIVE, fixed.method, fixed.num_draft_tokens)
    job = {"model": args.model, "mode": "waves", "prompts": ids, "concurrency": concurrency,
           "repeats": args.repeats, "max_tokens": args.max_tokens,
           "min_prompts": args.min_prompts}
    results: dict[str, Any] = {}
    for engine in engines:
        if engine == "sglang":
            python, env, extra = _sglang_setup(args)
            extra = {**extra, "max_total_tokens": 32768}
        else:
            python, env, extra = sys.executable, {"VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", "2")}, {}
        profile = (Path(given[engine]) if engine in given
                   else measure_profile(engine, fixed, ids, args, python, env, extra))
        if args.profile_only:
            continue
        runs: dict[str, dict[str, Any]] = {}
        launches = {}
        # repeats interleaved across baselines (AR, fixed, adaptive, AR, ...), one engine
        # start each: drift of a shared machine falls on every baseline alike
        for repeat in range(args.repeats):
            for b, prof in ((Baseline("ar", "ar", 0), None), (fixed, None), (adaptive, profile)):
                launch = engine_launch(engine, b, prof, args, extra)
                launches[b.label] = launch
                log = (args.out / f"{engine}-{b.label.replace(':', '-').replace(' ', '-')}"
                                  f"-r{repeat}.log")
                result = run_worker(engine, b.label, launch, {**job, "repeats": 1}, python,
                                    env, log, args.timeout)
                run = runs.setdefault(b.label, {"waves": []})
                if "error" in result:
                    run["error"] = result["error"]
                    continue
                for row in result["waves"]:
                    if repeat:
                        row.pop("token_ids", None)
                    run["waves"].append({**row, "repeat": repeat})
        results[engine] = {"profile": str(profile), "launch": launches, "runs": runs,
                           "rows": summarize(runs, concurrency) if "error" not in runs["ar"]
                           else [{"baseline": "ar", "error": runs["ar"]["error"]}]}
    meta = {"command": command_line("sweep", argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "note": f"{args.dataset} prompts (cut to {args.prompt_budget} tokens), "
                    f"{args.max_tokens} tokens each, greedy, fp32, EOS ignored; "
                    f"max({args.min_prompts}, 2c) prompts per concurrency in waves of c; {args.repeats} repeats, "
                    f"interleaved across baselines (one engine start each)"}
    if args.profile_only:
        return 0
    engine_rows = {e: r["rows"] for e, r in results.items()}
    (args.out / "sweep.json").write_text(json.dumps({"meta": meta, "engines": results}) + "\n")
    (args.out / "sweep.md").write_text(render(engine_rows, meta) + "\n")
    png = plot(engine_rows, args.out)
    print(render(engine_rows, meta))
    if png:
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
