"""Two checkouts of diffspec through vLLM's OpenAI server, rounds interleaved: is a change
faster, beyond the noise of the machine?

    python -m benchmarks code-ab --checkout before=/path/to/worktree --checkout after=. \\
        --tables gsm8k --concurrency 1,16 --rounds 3 --out DIR

Each ``--checkout NAME=PATH`` is a diffspec source tree (``.``: this one); its servers run
with ``PYTHONPATH=PATH``, so vLLM's plugin entry point imports that tree's diffspec (the
same venv, the same vLLM). Every round starts, in this order, vLLM's AR server (no
speculative config) and then one server per checkout with ``--speculative-config``
(default: diffspec's default, ``{"method": "orthrus"}``), each serving every concurrency
with vLLM's own client (``vllm bench serve``, the launch and client settings of
``benchmarks.serve_tables``: fp32, eager, greedy, chat template, ``--output-len`` tokens,
EOS ignored, ``max(--min-prompts, --waves x c)`` prompts at concurrency c). Drift of a
shared machine falls on every server of a round alike; each ratio is taken within its round
(checkout / AR and checkout / the first checkout). Every output is compared with AR's of
the same round (lossless methods: equal).

Writes ``OUT/code_ab.json`` (every cell, after each one) and ``OUT/code_ab.md`` (median and
min-max over the rounds: tokens/s, TPOT, x AR, x the first checkout, acceptance length,
outputs equal to AR), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser  # noqa: E402

AR = "ar"


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("code-ab", __doc__)
    p.add_argument("--checkout", action="append", required=True, metavar="NAME=PATH",
                   help="a diffspec source tree to serve (twice or more; '.': this one)")
    p.add_argument("--speculative-config", default='{"method": "orthrus"}',
                   help="the checkouts' --speculative-config (default: diffspec's default)")
    p.add_argument("--model", default=None,
                   help="checkpoint (default: the embedded default, prepared as "
                        "`diffspec quickstart` does)")
    p.add_argument("--tables", default="gsm8k", help="prompt sets: gsm8k, humaneval")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--waves", type=int, default=2, help="prompts per cell: waves x c at least")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per client run")
    p.add_argument("--out", type=Path, required=True)
    return p


def parse_checkouts(specs: list[str]) -> dict[str, Path]:
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or name == AR:
            raise SystemExit(f"code-ab: give --checkout NAME=PATH (NAME not {AR!r}), not {spec!r}")
        tree = Path(path).resolve()
        if not (tree / "diffspec" / "__init__.py").is_file():
            raise SystemExit(f"code-ab: {tree} is not a diffspec source tree "
                             f"(no diffspec/__init__.py)")
        out[name] = tree
    if len(out) < 2:
        raise SystemExit("code-ab: give at least two --checkout NAME=PATH")
    return out


def describe(tree: Path) -> str:
    """``tree``'s commit (short hash), with ``+ changes`` when its work tree differs."""
    import subprocess

    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "not a git checkout"
    return head + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def summarize(cells: list[dict[str, Any]], servers: list[str]) -> list[dict[str, Any]]:
    """Per (table, concurrency, server): medians and ranges over the rounds, ratios taken
    within each round."""
    rows = []
    first = servers[1]
    keys = sorted({(c["table"], c["concurrency"]) for c in cells})
    for table, conc in keys:
        by = {(c["server"], c["round"]): c for c in cells
              if c["table"] == table and c["concurrency"] == conc}
        rounds = sorted({r for _, r in by})
        for server in servers:
            mine = [by[(server, r)] for r in rounds if (server, r) in by]
            if not mine:
                continue

            def ratios(to: str, mine=mine, by=by) -> list[float]:
                return [c["tok_s"] / by[(to, c["round"])]["tok_s"] for c in mine
                        if (to, c["round"]) in by]

            rows.append({
                "table": table, "concurrency": conc, "server": server, "rounds": len(mine),
                "tok_s": [c["tok_s"] for c in mine], "tpot_ms": [c["tpot_ms"] for c in mine],
                "x_ar": ratios(AR) if server != AR else [],
                "x_first": ratios(first) if server not in (AR, first) else [],
                "acceptance_length": [c["acceptance_length"] for c in mine
                                      if c["acceptance_length"]],
                "same_as_ar": [c["same_as_ar"] for c in mine if c.get("same_as_ar")],
            })
    return rows


def _spread(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "—"
    med = statistics.median(xs)
    return (f"{med:.{digits}f}" if len(xs) == 1
            else f"{med:.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})")


def render(rows: list[dict[str, Any]], servers: list[str]) -> str:
    head = (f"| set | c | server | tok/s | TPOT ms | x AR | x {servers[1]} | acceptance "
            f"length | outputs = AR |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = (f"{sum(m for m, _ in r['same_as_ar'])}/{sum(n for _, n in r['same_as_ar'])}"
                if r["same_as_ar"] else "—")
        lines.append(f"| {r['table']} | {r['concurrency']} | {r['server']} | "
                     f"{_spread(r['tok_s'], 1)} | {_spread(r['tpot_ms'], 1)} | "
                     f"{_spread(r['x_ar'])} | {_spread(r['x_first'])} | "
                     f"{_spread(r['acceptance_length'])} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    checkouts = parse_checkouts(args.checkout)
    from benchmarks.baselines import Baseline
    from benchmarks.datasets import load_prompts
    from benchmarks.serve_tables import prompts_for, same_outputs, server_args
    from benchmarks.vllm_bench_serve import require_client, run_client
    from diffspec.serving import ServerProcess, free_port, vllm_server_command

    require_client()
    if args.model is None:
        from diffspec.default_model import prepare_default
        args.model = str(prepare_default())
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tables = args.tables.split(",")
    out, work = args.out, args.out / "work"
    (work / "client").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / ".gitignore").write_text("*\n")
    need = max(prompts_for(c, args.min_prompts, args.waves) for c in concurrency)
    prompt_files = {}
    for t in tables:
        prompts = load_prompts(t, None, need)
        prompt_files[t] = work / f"{t}.jsonl"
        prompt_files[t].write_text("".join(json.dumps({"prompt": p.text}) + "\n"
                                           for p in prompts))
    servers = [AR, *checkouts]
    launch = server_args(Baseline(AR, "ar", 0), args)  # serve_tables' launch settings
    state_path = out / "code_ab.json"
    state = {"meta": {"command": command_line("code-ab", argv),
                      "checkouts": {k: f"{v} ({describe(v)})" for k, v in checkouts.items()},
                      "speculative_config": args.speculative_config,
                      "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
             "cells": []}
    outputs: dict[tuple, list] = {}
    for rnd in range(args.rounds):
        for server in servers:
            tree = ROOT if server == AR else checkouts[server]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                       [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
            spec = [] if server == AR else ["--speculative-config", args.speculative_config]
            port = free_port()
            cmd = vllm_server_command(args.model, port, *launch, *spec)
            state["meta"].setdefault("launch", {})[server] = shlex.join(cmd)
            print(f"[code-ab] round {rnd} {server}: starting", file=sys.stderr, flush=True)
            with ServerProcess(cmd, port, engine="vllm", env=env,
                               log_path=work / "logs" / f"{server}-r{rnd}.log") as proc:
                proc.wait_ready(900)
                for t in tables:
                    for c in concurrency:
                        n = prompts_for(c, args.min_prompts, args.waves)
                        stem = f"{t}-{server}-r{rnd}"
                        data = run_client(port, "model", args.model, prompt_files[t], n,
                                          args.output_len, c, work / "client", stem,
                                          save_detailed=True,
                                          log=work / "logs" / f"client-{stem}-c{c}.log",
                                          timeout_s=args.timeout)
                        if data.get("failed") or data["completed"] != n:
                            raise RuntimeError(f"{stem} c={c}: requests failed (see "
                                               f"{work / 'logs'})")
                        texts = data["generated_texts"]
                        outputs[(t, c, server, rnd)] = texts
                        ar = outputs.get((t, c, AR, rnd))
                        cell = {"table": t, "concurrency": c, "server": server, "round": rnd,
                                "tok_s": data["total_output_tokens"] / data["duration"],
                                "tpot_ms": data.get("mean_tpot_ms"),
                                "ttft_ms": data.get("mean_ttft_ms"),
                                "acceptance_length": data.get("spec_decode_acceptance_length"),
                                "same_as_ar": (list(same_outputs(texts, ar))
                                               if ar is not None and server != AR else None)}
                        state["cells"].append(cell)
                        state_path.write_text(json.dumps(state, indent=1))
                        print(f"[code-ab] round {rnd} {server} {t} c={c}: "
                              f"{cell['tok_s']:.1f} tok/s, TPOT {cell['tpot_ms']:.1f} ms",
                              file=sys.stderr, flush=True)
    rows = summarize(state["cells"], servers)
    state["summary"] = rows
    state_path.write_text(json.dumps(state, indent=1))
    table = render(rows, servers)
    trees = ", ".join(f"{k}: {v}" for k, v in state["meta"]["checkouts"].items())
    (out / "code_ab.md").write_text(f"`{state['meta']['command']}` ({state['meta']['started']};"
                                    f" {trees})\n\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
