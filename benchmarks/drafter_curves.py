"""Two drafters' training curves on one compute axis: acceptance length against CPU-minutes.

    python -m benchmarks drafter-curves \\
        --run orthrus=FIRST/training.json,CONTINUED/training.json \\
        --run eagle3=EAGLE3/training.json \\
        --measured orthrus@60=REPORT.json#orthrus:7 --measured eagle3@145=REPORT.json#eagle3:3 \\
        --out DIR

``--run NAME=REC[,REC...]``: a drafter's ``training.json`` records, one per run, in the
order they ran (a run started with ``--init-heads`` continues the one before it: its
CPU-minutes and tokens are added after the earlier run's). Each logged step's training
estimate of the acceptance length (:func:`benchmarks.compare.curve_points`: teacher-forced
on that step's rows before the update) is placed at the run's CPU time spread evenly over
its steps (the records keep the total, not a time per step). ``--measured
NAME@CPU_MIN=REPORT.json#BASELINE``: a point measured by the engine itself (the driver's
report: vLLM's acceptance counters), the figure that judges a drafter.

Prints a table, writes ``DIR/drafter_curves.json`` and ``DIR/drafter_curves.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import name_value, verb_parser
from benchmarks.plots import pyplot, save
from benchmarks.compare import _smooth, curve_points

__all__ = ["chained_curve", "main", "measured_point"]


def chained_curve(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The training-estimate points of runs that continue one another: ``cpu_min`` (the
    run's CPU time spread evenly over its steps, plus all earlier runs'), ``tokens``
    (likewise offset) and ``estimate``."""
    out: list[dict[str, float]] = []
    cpu0 = tok0 = 0.0
    for rec in records:
        points = curve_points(rec)
        steps = rec.get("steps") or len(points)
        every = rec.get("history_every") or 1
        cpu = float(rec["cpu_time_s"]) / 60
        for i, (tokens, est) in enumerate(points):
            step = min(i * every, steps - 1) if i < len(points) - 1 else steps - 1
            out.append({"cpu_min": cpu0 + cpu * (step + 1) / steps,
                        "tokens": tok0 + tokens, "estimate": est})
        cpu0 += cpu
        tok0 += float(rec["tokens_seen"])
    return out


def measured_point(report: dict[str, Any], baseline: str) -> dict[str, Any]:
    """The engine-measured acceptance length and per-position acceptance of ``baseline``
    in a driver report."""
    for r in report["results"]:
        if r["baseline"] == baseline:
            if r["error"]:
                raise ValueError(f"baseline {baseline} failed in that report: "
                                 f"{r['error'].splitlines()[0]}")
            return {"acceptance_length": r["overall"]["acceptance_length"],
                    "acceptance_per_position": r.get("acceptance_per_position"),
                    "date": report["meta"].get("date")}
    have = ", ".join(r["baseline"] for r in report["results"])
    raise ValueError(f"name a baseline the report has ({have}); {baseline!r} is not there")


def _parse_measured(item: str) -> tuple[str, float, Path, str]:
    try:
        head, rest = item.split("=", 1)
        name, cpu = head.split("@", 1)
        path, baseline = rest.rsplit("#", 1)
        return name, float(cpu), Path(path), baseline
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"write --measured as NAME@CPU_MIN=REPORT.json#BASELINE, got {item!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("drafter-curves", __doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=REC[,REC...]",
                   type=name_value("NAME=REC[,REC...]"),
                   help="a drafter's training.json records, in the order the runs ran")
    p.add_argument("--measured", action="append", default=[], type=_parse_measured,
                   metavar="NAME@CPU_MIN=REPORT.json#BASELINE",
                   help="an engine-measured acceptance length at a CPU budget")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    result: dict[str, Any] = {"curves": {}, "measured": []}
    for name, recs in args.run:
        paths = recs.split(",")
        records = [json.loads(Path(r).read_text()) for r in paths]
        result["curves"][name] = {"records": paths, "points": chained_curve(records)}
    for name, cpu, path, baseline in args.measured:
        point = measured_point(json.loads(path.read_text()), baseline)
        result["measured"].append({"drafter": name, "cpu_min": cpu, "report": str(path),
                                   "baseline": baseline, **point})

    print("| drafter | CPU-min | training tokens | training estimate (last 10 steps) |")
    print("|---|---|---|---|")
    for name, c in result["curves"].items():
        pts = c["points"]
        tail = pts[-10:]
        est = sum(q["estimate"] for q in tail) / len(tail)
        print(f"| {name} | {pts[-1]['cpu_min']:.0f} | {pts[-1]['tokens']:,.0f} | {est:.2f} |")
    if result["measured"]:
        print("\n| drafter | CPU-min | baseline | engine-measured AL | report |")
        print("|---|---|---|---|---|")
        for m in result["measured"]:
            print(f"| {m['drafter']} | {m['cpu_min']:.0f} | {m['baseline']} | "
                  f"{m['acceptance_length']:.2f} | {m['report']} |")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_curves.json").write_text(json.dumps(result, indent=1) + "\n")
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return 0
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colors = {}
    for name, c in result["curves"].items():
        pts = _smooth([(q["cpu_min"], q["estimate"]) for q in c["points"]], 10)
        (line,) = ax.plot([q[0] for q in pts], [q[1] for q in pts],
                          label=f"{name}: training estimate")
        colors[name] = line.get_color()
    for m in result["measured"]:
        ax.scatter([m["cpu_min"]], [m["acceptance_length"]], marker="o",
                   color=colors.get(m["drafter"]), zorder=3)
        ax.annotate(f"{m['baseline']}: {m['acceptance_length']:.2f}",
                    (m["cpu_min"], m["acceptance_length"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("training CPU-minutes (one thread)")
    ax.set_ylabel("acceptance length")
    ax.set_title("lines: training estimate (mean of 10 steps); dots: vLLM-measured", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save(fig, args.out / "drafter_curves.png", dpi=100)
    print(f"\nwrote {args.out / 'drafter_curves.json'} and {args.out / 'drafter_curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
