"""One comparison table across datasets: the driver's reports side by side, every speed as a
ratio to the same engine's AR row of the same run, plus the drafters' training curves.

    python -m benchmarks compare --reports R1/report.json R2/report.json ... \\
        [--curve orthrus=RUN/training.json --curve eagle3=RUN/training.json] --out DIR

Writes ``DIR/comparison.md`` (the table, the commands and dates of the runs it reads),
``DIR/comparison.json``, ``DIR/speedup.png`` (tokens/s / AR per dataset and concurrency)
and, with ``--curve``, ``DIR/acceptance_curve.png`` (each drafter's acceptance estimate
against training tokens, from its ``training.json`` history). Nothing is measured here:
every figure comes from the reports and records it reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import name_value, verb_parser
from benchmarks.plots import pyplot, save

__all__ = ["compare", "curve_points", "main", "rows_of"]


def rows_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per baseline that ran: dataset, engine, baseline, acceptance length, TPF,
    tokens/s per concurrency and each as a ratio to the engine's AR row, lossless."""
    dataset = report["meta"]["dataset"]
    if report["meta"].get("data_path") and dataset == "jsonl":
        dataset = Path(report["meta"]["data_path"]).stem
    ar = {r["engine"]: r for r in report["results"] if r["baseline"] == "ar" and not r["error"]}
    rows = []
    for r in report["results"]:
        if r["error"]:
            rows.append({"dataset": dataset, "engine": r["engine"], "baseline": r["baseline"],
                         "error": r["error"].splitlines()[0][:200]})
            continue
        base = ar.get(r["engine"])
        o = r["overall"]
        row = {"dataset": dataset, "engine": r["engine"], "baseline": r["baseline"],
               "acceptance_length": o["acceptance_length"], "tpf": o["tpf"],
               "lossless": o["lossless"], "tokens": o["tokens"],
               "untrained_drafter": r.get("untrained_drafter", False),
               "tokens_per_s": {}, "ratio_to_ar": {}}
        for c, v in sorted(r["system_tokens_per_s"].items(), key=lambda kv: int(kv[0])):
            row["tokens_per_s"][int(c)] = v
            ref = base["system_tokens_per_s"].get(c) if base else None
            row["ratio_to_ar"][int(c)] = v / ref if ref else None
        rows.append(row)
    return rows


def curve_points(record: dict[str, Any]) -> list[tuple[int, float]]:
    """(training tokens, acceptance-length estimate) per logged step of a ``training.json``:
    Orthrus answer rows log ``est_al`` (1 + mean accepted drafts of a full block), EAGLE-3
    logs ``chain_k`` (1 + their sum: the estimate for its ``ttt_steps`` drafts). Both are
    measured on each step's rows before the update, teacher-forced on the model's own
    greedy answers; EAGLE-3's history lacks per-step token counts in older runs, which are
    then spread evenly over its steps."""
    hist = record["history"]
    every = record.get("history_every", 1)
    out = []
    total_steps = record.get("steps") or len(hist)
    for i, h in enumerate(hist):
        if "est_al" in h:
            est = h["est_al"]
        else:
            chains = [v for k, v in sorted(h.items()) if k.startswith("chain_")]
            if not chains:
                continue
            est = 1 + sum(chains)
        if "tokens_seen" in h:
            tokens = h["tokens_seen"]
        else:  # EAGLE-3 records: history[::every] + the last entry
            step = min(i * every, total_steps - 1) if i < len(hist) - 1 else total_steps - 1
            tokens = round(record["tokens_seen"] * (step + 1) / total_steps)
        out.append((tokens, est))
    return out


def _smooth(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    out = []
    for i in range(len(points)):
        part = points[max(0, i - window + 1): i + 1]
        out.append((points[i][0], sum(p[1] for p in part) / len(part)))
    return out


def _fmt(v: Any, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]], concurrencies: list[int]) -> list[str]:
    head = ["dataset", "engine", "baseline", "acc. len", "TPF"]
    for c in concurrencies:
        head += [f"tok/s c={c}", f"x AR c={c}"]
    head.append("lossless")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dataset']} | {r['engine']} | {r['baseline']} | failed: "
                         f"{r['error']} |" + " |" * (len(head) - 4))
            continue
        cells = [r["dataset"], r["engine"], r["baseline"]
                 + (" (untrained drafter)" if r["untrained_drafter"] else ""),
                 _fmt(r["acceptance_length"]), _fmt(r["tpf"])]
        for c in concurrencies:
            cells += [_fmt(r["tokens_per_s"].get(c), 1), _fmt(r["ratio_to_ar"].get(c))]
        cells.append(_fmt(r["lossless"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compare(reports: list[Path], out: Path, curves: dict[str, Path] | None = None
            ) -> dict[str, Any]:
    loaded = [json.loads(Path(p).read_text()) for p in reports]
    rows = [row for rep in loaded for row in rows_of(rep)]
    concurrencies = sorted({c for r in rows for c in r.get("tokens_per_s", {})})
    runs = [{"report": str(p), "command": rep["meta"]["command"], "date": rep["meta"]["date"],
             "machine": rep["meta"]["machine"], "git_commit": rep["meta"].get("git_commit")}
            for p, rep in zip(reports, loaded, strict=True)]
    result: dict[str, Any] = {"rows": rows, "runs": runs, "curves": {}}
    out.mkdir(parents=True, exist_ok=True)
    for name, path in (curves or {}).items():
        rec = json.loads(Path(path).read_text())
        result["curves"][name] = {"record": str(path), "points": curve_points(rec),
                                  "cpu_time_s": rec.get("cpu_time_s"),
                                  "tokens_seen": rec.get("tokens_seen")}
    lines = ["# Drafters compared, one engine", "", *table(rows, concurrencies), "",
             ("Ratios divide each row's tokens/s by the same engine's AR row in the same run "
              "(same prompts, same concurrency). Runs read:"), ""]
    for run in runs:
        lines.append(f"- `{run['command']}` ({run['date']}, {run['machine'].get('nproc')} "
                     f"cores, {run['machine'].get('cpu')}, commit "
                     f"{(run['git_commit'] or '?')[:10]})")
    for name, c in result["curves"].items():
        pts = c["points"]
        if pts:
            lines.append(f"- training curve `{name}`: {c['record']} ({c['tokens_seen']:,} "
                         f"tokens, {c['cpu_time_s']} s CPU; last estimate "
                         f"{pts[-1][1]:.2f})")
    lines.append("")
    (out / "comparison.md").write_text("\n".join(lines))
    (out / "comparison.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, concurrencies, out)
    print("\n".join(lines))
    return result


def _plot(result: dict[str, Any], concurrencies: list[int], out: Path) -> None:
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return
    rows = [r for r in result["rows"] if "error" not in r]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    baselines = list(dict.fromkeys(r["baseline"] for r in rows))
    caption = "; ".join(f"{r['date']}" for r in result["runs"][:1])
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4),
                             squeeze=False)
    width = 0.8 / max(1, len(baselines))
    for ax, c in zip(axes[0], concurrencies, strict=True):
        for j, b in enumerate(baselines):
            vals = [next((r["ratio_to_ar"].get(c) or 0 for r in rows
                          if r["dataset"] == d and r["baseline"] == b), 0) for d in datasets]
            ax.bar([i + j * width for i in range(len(datasets))], vals, width, label=b)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([i + width * (len(baselines) - 1) / 2 for i in range(len(datasets))])
        ax.set_xticklabels(datasets)
        ax.set_ylabel("tokens/s / AR")
        ax.set_title(f"concurrency {c}")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"speed vs AR, same run ({caption})", fontsize=9)
    save(fig, out / "speedup.png", dpi=100)
    if result["curves"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, c in result["curves"].items():
            pts = _smooth(c["points"], 10)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("acceptance length estimate (mean of 10 steps)")
        ax.legend()
        save(fig, out / "acceptance_curve.png", dpi=100)


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("compare", __doc__)
    p.add_argument("--reports", nargs="+", required=True, type=Path,
                   help="report.json files of benchmarks.driver runs")
    p.add_argument("--curve", action="append", default=[], metavar="NAME=training.json",
                   type=name_value("NAME=training.json"),
                   help="a drafter's training record (repeatable)")
    p.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    compare(args.reports, args.out, {name: Path(path) for name, path in args.curve})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
