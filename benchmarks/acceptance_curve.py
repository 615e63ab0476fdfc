"""Acceptance of Orthrus heads against training tokens, measured on held-out answers.

    python -m benchmarks acceptance-curve --base BASE --run RUN_DIR --data HELDOUT_DIR \\
        [--max-rows 32] --out DIR

``RUN_DIR`` is an ``orthrus --answers-only --snapshot-every N`` output: the heads in
``RUN_DIR/snapshots/step-*`` and the final heads in ``RUN_DIR``; ``HELDOUT_DIR`` holds the
model's greedy answers to held-out prompts (``python -m training.sharegpt generate
--split held-out``), rows no trainer read. For each heads folder (and the untrained heads,
``B = 0``, or the heads folder the run started from with ``--init-heads``: then tokens
count that folder's training too), :func:`diffspec.train.orthrus.measure_answer_acceptance`
gives the acceptance length of a full block and the acceptance per draft position,
teacher-forced on those answers: what a greedy verify accepts when the model decodes them. Training tokens come
from the run's ``training.json``. Writes ``DIR/acceptance_curve.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks import command_line, verb_parser
from benchmarks.plots import pyplot, save


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("acceptance-curve", __doc__)
    p.add_argument("--base", required=True)
    p.add_argument("--run", required=True, type=Path)
    p.add_argument("--data", required=True, nargs="+")
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--max-anchors", type=int, default=64,
                   help="answer anchors per row (seeded, the same for every heads folder)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from diffspec.model_executors.reference.orthrus import load_orthrus_heads, orthrus_from_base
    from diffspec.train.data import load_rows
    from diffspec.train.orthrus import measure_answer_acceptance

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    files = []
    for d in args.data:  # held-out folders are refused by data_files: read their shards
        files += sorted(Path(d).glob("*.jsonl")) if Path(d).is_dir() else [Path(d)]
    rows, _ = load_rows(None, args.seq_len, files=files)
    rows = rows[:args.max_rows]
    record = json.loads((args.run / "training.json").read_text())
    steps_tokens = {i + 1: h["tokens_seen"] for i, h in enumerate(record["history"])}
    folders = sorted((args.run / "snapshots").glob("step-*")) + [args.run]
    heads = json.loads((args.run / "heads.json").read_text())
    points = []
    # the run's starting point: untrained heads, or the heads folder it continued
    # (--init-heads; its tokens are the ones that folder's own run had seen)
    init = record["config"].get("extra", {}).get("init_heads")
    t0 = time.perf_counter()
    if init:
        start = load_orthrus_heads(args.base, init)
        before = json.loads((Path(init) / "training.json").read_text())["tokens_seen"]
        label = f"start: {init}"
    else:
        start = orthrus_from_base(args.base, heads["block_size"], heads["mask_token_id"],
                                  rank=heads["rank"])
        before, label = 0, "untrained (B = 0)"
    points.append({"heads": label, "step": 0, "tokens": before,
                   **measure_answer_acceptance(start, rows, max_anchors=args.max_anchors)})
    del start
    for folder in folders:
        rec = json.loads((folder / "training.json").read_text())
        model = load_orthrus_heads(args.base, folder)
        m = measure_answer_acceptance(model, rows, max_anchors=args.max_anchors)
        step = rec["steps"]
        points.append({"heads": str(folder), "step": step,
                       "tokens": before + steps_tokens.get(step, rec["tokens_seen"]), **m})
        print(f"{folder.name}: step {step}, {points[-1]['tokens']:,} tokens, "
              f"AL {m.get('est_al', float('nan')):.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"command": command_line("acceptance-curve", argv or []),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "rows": len(rows), "max_anchors": args.max_anchors, "data": [str(f) for f in files],
           "points": points,
           "seconds": round(time.perf_counter() - t0, 1)}
    (args.out / "acceptance_curve.json").write_text(json.dumps(out, indent=2) + "\n")
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([q["tokens"] for q in points], [q["est_al"] for q in points], marker="o")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(f"acceptance length ({heads['block_size'] - 1} drafts)")
    ax.set_title(f"Orthrus heads on {len(rows)} held-out answers ({out['date']})", fontsize=9)
    save(fig, args.out / "acceptance_curve.png", dpi=100)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
