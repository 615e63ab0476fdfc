"""Forward-latency profiler: the time of one forward with Q query tokens (1..64) over a KV
cache of C context tokens (256..8k), for a checkpoint or a model shape with random weights,
on CPU or CUDA.

Speculative decoding trades forwards for wider forwards; where a wider forward costs no
more than a narrow one (memory-bound decode), drafting more pays. ``recommend_block_size``
combines these latencies with measured acceptance to pick the block size that maximizes
expected tokens per second; the driver does so with ``--profile forward_latency.json``.

A full 8B model does not fit a small CPU machine (Qwen3-8B in fp32 is ~33 GB), so
``--layers 1,2`` builds the real shape with only 2 decoder layers, times the forward with 1
and with 2 of them (same KV cache), fits latency = fixed + per-layer x layers per
(context, query) cell and extrapolates to the shape's full depth. The JSON then holds the
measured tables and the extrapolated one (``latency_s``, marked ``"extrapolated"``); the
extrapolation ignores cache effects of a larger working set, so it is an estimate.

    python -m benchmarks profile-forward --shape qwen3-8b --layers 1,2 --out results/
    python -m benchmarks profile-forward --shape qwen3-8b --device cuda --out results/
    python -m benchmarks profile-forward --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from diffspec.profiling import forward_latency

# name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab). Built as Qwen3
# (the others' dimensions on a Qwen3 block: NLD-8B is Ministral3, SmolLM2 is Llama; the
# per-token cost of a decoder layer is set by these dimensions, not the family).
SHAPES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (2, 128, 4, 2, 32, 320, 208),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144, 151936),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728, 151936),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936),
    "nld-8b": (34, 4096, 32, 8, 128, 14336, 131072),
}
DEFAULT_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXTS = (256, 1024, 4096, 8192)


def recommend_block_size(acceptance_per_position: list[float],
                         latency_by_query_len: dict[int, float],
                         forwards_per_step: int = 1) -> int:
    """The block size B (query tokens per verify forward: the anchor + B-1 drafts) with the
    highest expected tokens per second, among the measured query lengths.

    ``acceptance_per_position[i]``: probability that draft i (0-based) is accepted, i.e.
    that drafts 0..i all are (vLLM's accepted-per-position counter / verify steps).
    A step with B-1 drafts commits 1 + sum(acceptance[:B-1]) tokens in expectation and
    costs ``forwards_per_step`` forwards of B query tokens (self-speculation: 2, draft +
    verify). B = 1 is plain AR. Query lengths beyond the measured acceptance count the
    missing positions as never accepted. The maths is the adaptive policy's
    (:func:`diffspec.core.adaptive.tokens_per_second`, one forward per step a ``linear``
    :class:`~diffspec.core.adaptive.StepCost`, two a ``two_pass`` one).
    """
    from diffspec.core.adaptive import (
        LatencyProfile,
        StepCost,
        conditional_acceptance,
        tokens_per_second,
    )

    if not latency_by_query_len:
        raise ValueError("latency_by_query_len is empty")
    costs = {1: StepCost("linear"), 2: StepCost("two_pass")}
    if forwards_per_step not in costs:
        raise ValueError(f"forwards_per_step is 1 or 2, got {forwards_per_step}")
    profile = LatencyProfile(latency_by_query_len)
    acceptance = conditional_acceptance(acceptance_per_position)
    return max(sorted(latency_by_query_len), key=lambda block: tokens_per_second(
        acceptance, block - 1, profile, costs[forwards_per_step]))


def build_model(model: str | None, shape: str | None, layers: int | None, vocab: int | None,
                dtype: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """A causal LM from a checkpoint folder, or a random-weight Qwen3 of a built-in shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    if model is not None:
        config = AutoConfig.from_pretrained(model)
        if layers is not None:
            config.num_hidden_layers = layers
        lm = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=dtype)
        desc = {"model": model}
    else:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        n_layers, hidden, heads, kv, head_dim, inter, n_vocab = SHAPES[shape]
        config = Qwen3Config(num_hidden_layers=layers or n_layers, hidden_size=hidden,
                             num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=head_dim, intermediate_size=inter,
                             vocab_size=vocab or n_vocab, max_position_embeddings=40960,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
        desc = {"shape": shape}
    lm = lm.to(device).eval()
    c = lm.config
    desc.update(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, vocab=c.vocab_size)
    return lm, desc


def extrapolate(tables: dict[int, dict[int, dict[int, float]]],
                full_layers: int) -> dict[int, dict[int, float]]:
    """Latency at ``full_layers`` from tables measured at two or more layer counts: a
    least-squares line fixed + per_layer x layers per (context, query) cell (per-layer
    cost clamped at >= 0 against timing noise)."""
    counts = sorted(tables)
    if len(counts) < 2:
        raise ValueError("extrapolation needs tables at two or more layer counts")
    mean_n = statistics.fmean(counts)
    out: dict[int, dict[int, float]] = {}
    for ctx, row in tables[counts[0]].items():
        out[ctx] = {}
        for q in row:
            ts = [tables[n][ctx][q] for n in counts]
            mean_t = statistics.fmean(ts)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(counts, ts)) / sum(
                (n - mean_n) ** 2 for n in counts)
            slope = max(0.0, slope)
            out[ctx][q] = mean_t + slope * (full_layers - mean_n)
    return out


def format_table(table: dict[int, dict[int, float]]) -> str:
    """Markdown: one row per context length, one column per query length (ms)."""
    query_lens = sorted({q for row in table.values() for q in row})
    lines = ["| context \\ query tokens | " + " | ".join(str(q) for q in query_lens) + " |",
             "|" + "---|" * (len(query_lens) + 1)]
    for ctx in sorted(table):
        lines.append(f"| {ctx} | " + " | ".join(f"{table[ctx][q] * 1000:.2f}"
                                                for q in query_lens) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def inconsistent_cells(tables: dict[int, dict[int, dict[int, float]]]) -> list[str]:
    """``"context/query"`` cells where a forward through more layers measured faster than
    through fewer: timing noise exceeds the per-layer cost there, and the extrapolation
    from these tables is not to be trusted (rerun on a quieter machine, more repeats)."""
    counts = sorted(tables)
    return [f"{ctx}/{q}" for ctx, row in tables[counts[0]].items() for q in row
            if any(tables[b][ctx][q] < tables[a][ctx][q] for a, b in itertools.pairwise(counts))]


def free_query_len(row: dict[int, float], tolerance: float = 0.10) -> int:
    """The widest measured forward costing at most ``1 + tolerance`` times a one-token
    forward: up to there extra draft tokens are (nearly) free."""
    return max(q for q, t in row.items() if t <= (1 + tolerance) * row[min(row)])


def plot(result: dict[str, Any], out: Path) -> Path | None:
    """``forward_latency.png``: latency vs query tokens, one line per context length,
    captioned with the command, device and date. An extrapolation that its own tables
    contradict (:func:`inconsistent_cells`) is not drawn: the measured table at the most
    layers is, and the title says so. None without matplotlib."""
    from benchmarks.plots import pyplot, save  # here: the file also runs as a script

    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return None
    table, kind = result["latency_s"], "measured"
    if result.get("extrapolated"):
        measured = {int(n): {int(c): {int(q): t for q, t in row.items()} for c, row in t.items()}
                    for n, t in result["measured_s"].items()}
        if inconsistent_cells(measured):
            most = str(max(measured))
            table = result["measured_s"][most]
            kind = f"measured with {most} of {result['full_layers']} layers; extrapolation noisy"
        else:
            kind = f"extrapolated to {result['full_layers']} layers"
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for ctx, row in table.items():
        qs = sorted(int(q) for q in row)
        ax.plot(qs, [row[str(q)] * 1000 for q in qs], marker="o", label=f"context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="query tokens per forward", ylabel="ms per forward",
           title=f"forward latency, {result['model'].get('shape') or result['model'].get('model')}"
                 f"\n({kind})")
    ax.legend(fontsize=7)
    device = (f"device: {result['device_name']} ({result['device']}, {result['dtype']}, "
              f"{result['threads']} threads); date: {result['date']}")
    caption = "\n".join([*textwrap.wrap(f"command: {result['command']}", 130), device])
    fig.text(0.01, 0.005, caption, fontsize=6, va="bottom")
    return save(fig, out / "forward_latency.png", dpi=100, rect=(0, 0.07, 1, 1))


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import verb_parser  # here: the file also runs as a script

    p = verb_parser(
        "profile-forward",
        description="Time one forward with 1..64 query tokens over 256..8k context tokens "
        "(median or min of --repeats, after a warm-up), print a table (ms), save JSON + PNG.",
        formatter_class=argparse.HelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local checkpoint folder")
    src.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                     help="random-weight Qwen3 of this shape (default: tiny)")
    p.add_argument("--layers", type=_ints, default=None,
                   help="decoder layers to build: N (a truncated model), or N1,N2,... (build "
                   "max, time each count, extrapolate to the shape's full depth)")
    p.add_argument("--vocab", type=int, help="override the vocabulary size (--shape only)")
    p.add_argument("--query-lens", type=_ints, default=list(DEFAULT_QUERY_LENS),
                   help="comma-separated (default: 1,2,4,8,16,32,64)")
    p.add_argument("--contexts", type=_ints, default=list(DEFAULT_CONTEXTS),
                   help="comma-separated (default: 256,1024,4096,8192)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None,
                   help="float32 / bfloat16 / float16 (default: float32 on CPU, bf16 on CUDA)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="of the repeats (default median; min on a machine shared with "
                   "other work)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", type=Path, help="folder for forward_latency.json / .png")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks import command_line  # here: the file also runs as a script

    args = build_parser().parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    counts = sorted(set(args.layers)) if args.layers else None
    lm, desc = build_model(args.model, None if args.model else args.shape,
                           max(counts) if counts else None, args.vocab,
                           getattr(torch, dtype_name), args.device)
    tables = forward_latency(lm, args.query_lens, args.contexts, args.repeats, args.device,
                             counts, args.stat)
    full_layers = (SHAPES[args.shape][0] if not args.model else
                   json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"])
    extrapolated = counts is not None and len(counts) > 1
    table = extrapolate(tables, full_layers) if extrapolated else tables[max(tables)]
    device_name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                   else _cpu_model())

    def as_json(t: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
        return {str(c): {str(q): v for q, v in row.items()} for c, row in t.items()}

    result = {
        "command": command_line("profile-forward", argv),
        "model": desc, "device": args.device, "device_name": device_name, "dtype": dtype_name,
        "threads": torch.get_num_threads(), "repeats": args.repeats, "stat": args.stat,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "full_layers": full_layers, "extrapolated": extrapolated,
        "measured_s": {str(n): as_json(t) for n, t in tables.items()},
        "latency_s": as_json(table),
        "free_query_len": {str(c): free_query_len(row) for c, row in table.items()},
        "inconsistent_cells": inconsistent_cells(tables) if extrapolated else [],
    }
    for n, t in tables.items():
        print(f"forward latency (ms), measured with {n} layer(s), {desc}, {args.device} "
              f"{dtype_name}\n{format_table(t)}\n")
    if extrapolated:
        print(f"extrapolated to {full_layers} layers (ms)\n{format_table(table)}\n")
        cells = result["inconsistent_cells"]
        if cells:
            print(f"WARNING: more layers measured faster than fewer in {len(cells)} cells "
                  f"({', '.join(cells)}): timing noise exceeds the per-layer cost; do not "
                  "trust the extrapolation")
    print("widest forward within 10% of a 1-token forward, per context: "
          + ", ".join(f"{c}: {q}" for c, q in result["free_query_len"].items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "forward_latency.json").write_text(json.dumps(result, indent=1))
        plot(result, args.out)
    return result


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
