"""The heads-recipe ablation's table (``bash benchmarks/smollm2_drafters.sh ablation``):
per arm, its training (settings, CPU minutes, steps, tokens) and what vLLM measured for its
heads on the held-out prompts (acceptance length at K = 7, tokens/s against AR, lossless).

    python -m training.ablation_table --runs runs/ablation --out benchmarks/results/X

Prints a Markdown table and writes ``ablation.json`` and ``ablation.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["ablation_rows", "main", "markdown"]

SETTINGS = ("rank", "block_size", "loss", "block_widths")


def ablation_rows(runs: Path) -> list[dict]:
    """One row per arm folder of ``runs`` that has a training record and a vLLM report
    (``ARM/training.json``, ``ARM-accept/report.json``), in name order."""
    rows = []
    for record_path in sorted(runs.glob("*/training.json")):
        arm = record_path.parent.name
        report_path = runs / f"{arm}-accept" / "report.json"
        if not report_path.is_file():
            continue
        record = json.loads(record_path.read_text())
        extra = record.get("config", {}).get("extra", {})
        results = json.loads(report_path.read_text())["results"]
        by_baseline = {r["baseline"]: r["overall"] for r in results if r.get("engine") == "vllm"}
        ar = by_baseline.get("ar")
        spec = next((o for b, o in by_baseline.items() if b.startswith("orthrus")), None)
        if spec is None:
            continue
        rows.append({
            "arm": arm,
            **{k: extra.get(k) for k in SETTINGS},
            "lr": record.get("config", {}).get("lr"),
            "cpu_minutes": round(record.get("cpu_time_s", 0.0) / 60, 1),
            "steps": record.get("steps"),
            "tokens_seen": record.get("tokens_seen"),
            "train_est_al": record.get("estimated_acceptance_length"),
            "vllm_acceptance_length": spec.get("acceptance_length"),
            "vs_ar": (spec["per_user_tokens_per_s"] / ar["per_user_tokens_per_s"]
                      if ar and ar.get("per_user_tokens_per_s") else None),
            "lossless": spec.get("lossless"),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, best vLLM acceptance length first."""
    head = ("| arm | rank | K | loss | widths | lr | CPU-min | steps | tokens | est. AL "
            "(train) | vLLM AL, K = 7 | tok/s vs AR | == AR |")
    lines = [head, "|" + "---|" * 13]

    def cell(value, fmt: str = "{}") -> str:
        return "—" if value is None else fmt.format(value)

    for r in sorted(rows, key=lambda r: -(r["vllm_acceptance_length"] or 0)):
        widths = ",".join(map(str, r["block_widths"])) if r["block_widths"] else "K"
        lines.append(
            f"| {r['arm']} | {cell(r['rank'])} | {cell(r['block_size'])} | "
            f"{cell(r['loss'] or 'kl')} | {widths} | {cell(r['lr'])} | "
            f"{cell(r['cpu_minutes'])} | {cell(r['steps'])} | {cell(r['tokens_seen'], '{:,}')} | "
            f"{cell(r['train_est_al'], '{:.2f}')} | {cell(r['vllm_acceptance_length'], '{:.2f}')} | "
            f"{cell(r['vs_ar'], '{:.2f}x')} | {cell(r['lossless'], '{:.0%}')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.ablation_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True,
                        help="the ablation folder: ARM/ (training) and ARM-accept/ (vLLM)")
    parser.add_argument("--out", type=Path, help="write ablation.json and ablation.md here")
    args = parser.parse_args(argv)
    rows = ablation_rows(args.runs)
    if not rows:
        parser.error(f"run the ablation stage first: no arm in {args.runs} has both "
                     f"ARM/training.json and ARM-accept/report.json")
    table = markdown(rows)
    print(table, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ablation.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "ablation.md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
