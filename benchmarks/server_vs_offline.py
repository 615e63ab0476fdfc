"""Where a step's time goes, offline (``vllm.LLM``) against vLLM's OpenAI server, on the same
prompts, baselines and CPU layout (issue 27 item 2).

    python -m benchmarks server-vs-offline --model MODEL --prompts prompts.jsonl \\
        --baselines ar,orthrus:3,orthrus --num-prompts 3 --output-len 128 --rounds 2 \\
        --layouts default,all-cores --out DIR

For each round, layout and baseline (repeats interleaved: a round runs every cell once),
both paths serve the same chat-templated prompts one at a time, greedy, ``--ignore-eos``,
after a one-prompt warm-up:

* **offline**: ``vllm.LLM`` in a subprocess, ``llm.generate`` per prompt;
* **server**: ``vllm serve`` (the same engine arguments) and vLLM's own client
  (``vllm bench serve``, ``--max-concurrency 1``; ``benchmarks.vllm_bench_serve.run_client``).

Both engines run with vLLM's ``--enable-logging-iteration-details``: every engine step logs
its scheduled tokens and its elapsed time (the engine core's step: scheduling, the worker's
forwards, sampling), so a path's wall time splits into time inside engine steps and time
between them (frontend, IPC, client). The CPU time of every process (engine core, worker,
API server) over the measured requests comes from ``/proc``, per output token. Layouts: ``default``
(vLLM's own OpenMP binding: on CPU it reserves one core for the frontend processes) and
``all-cores`` (``VLLM_CPU_OMP_THREADS_BIND`` set to every core; best on a machine nothing
else runs on). Prints a table and writes ``DIR/server_vs_offline.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import command_line, verb_parser  # noqa: E402

ITERATION = re.compile(r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens, \d+ generation "
                       r"requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms")
ENGINE_ARGS = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "seed": 0}
ROLES = {"VLLM::EngineCor": "engine core", "VLLM::Worker": "worker"}


def iterations(log_text: str) -> list[tuple[int, int, float]]:
    """Every ``(context tokens, generation tokens, elapsed ms)`` vLLM's iteration log holds."""
    return [(int(c), int(g), float(ms)) for c, g, ms in ITERATION.findall(log_text)]


def step_summary(its: list[tuple[int, int, float]], wall_s: float, tokens: int) -> dict[str, Any]:
    """Decode steps (no prompt tokens) and the share of the wall time inside engine steps."""
    decode = [(g, ms) for c, g, ms in its if c == 0]
    inside = sum(ms for _, _, ms in its) / 1000
    return {"tokens": tokens, "wall_s": wall_s, "tok_per_s": tokens / wall_s if wall_s else None,
            "ms_per_token": 1000 * wall_s / tokens if tokens else None,
            "steps": len(its), "decode_steps": len(decode),
            "decode_step_ms": statistics.mean(ms for _, ms in decode) if decode else None,
            "scheduled_per_step": statistics.mean(g for g, _ in decode) if decode else None,
            "tokens_per_step": tokens / len(decode) if decode else None,
            "inside_steps_s": inside, "outside_steps_s": wall_s - inside}


def process_cpu(pids: list[int]) -> dict[int, tuple[str, float]]:
    """``pid -> (name, user + system CPU seconds)`` of these processes and all their children."""
    hz = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
        children.setdefault(int(rest[1]), []).append(int(entry))
        stats[int(entry)] = (name, (int(rest[11]) + int(rest[12])) / hz)
    out, todo = {}, list(pids)
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in out:
            out[pid] = stats[pid]
            todo += children.get(pid, [])
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                main_role: str, tokens: int) -> dict[str, float]:
    """CPU milliseconds per output token between two snapshots, per role (engine core, worker, ...)."""
    roles: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        role = ROLES.get(name, main_role)
        roles[role] = roles.get(role, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    return {k: round(1000 * v / tokens, 2) for k, v in roles.items()}


def layout_env(layout: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if layout == "all-cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
    elif layout != "default":
        raise ValueError(f"layout {layout!r}: use default or all-cores")
    return env


def chat_prompts(model: str, prompts: Path, count: int) -> list[str]:
    """The first ``count + 1`` prompts in the model's chat template (as vLLM's client sends them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()]
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=False) for p in rows[:count + 1]]


def offline_worker(job_path: str) -> None:
    """Subprocess: ``vllm.LLM``, one warm-up prompt, then the measured prompts one at a time."""
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], **job["llm"], disable_log_stats=False,
              enable_logging_iteration_details=True)
    params = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True)
    llm.generate(job["prompts"][:1], params, use_tqdm=False)
    print("@@MEASURE", flush=True), print("@@MEASURE", file=sys.stderr, flush=True)
    Path(job["ready"]).write_text("")
    while Path(job["ready"]).exists():  # the parent snapshots the CPU counters
        time.sleep(0.05)
    start, tokens = time.perf_counter(), 0
    for prompt in job["prompts"][1:]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    print(f"@@DONE {json.dumps({'wall_s': wall, 'tokens': tokens})}", file=sys.stderr, flush=True)
    Path(job["ready"]).write_text("")
    while Path(job["ready"]).exists():
        time.sleep(0.05)


def run_offline(model: str, spec: dict | None, prompts: list[str], output_len: int, env: dict,
                work: Path, label: str) -> dict[str, Any]:
    llm = {**ENGINE_ARGS, "max_model_len": 2048, **({"speculative_config": spec} if spec else {})}
    ready = work / f"{label}.ready"
    job = {"model": model, "llm": llm, "prompts": prompts, "output_len": output_len, "ready": str(ready)}
    (work / f"{label}.job.json").write_text(json.dumps(job))
    log = work / f"{label}.offline.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.server_vs_offline", "--offline-worker",
                                 str(work / f"{label}.job.json")], cwd=ROOT, env=env, stdout=f, stderr=f)
        snaps = []
        for _ in range(2):
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"offline {label} failed: see {log}")
                time.sleep(0.05)
            snaps.append(process_cpu([proc.pid]))
            ready.unlink()
        proc.wait(timeout=120)
    text = log.read_text().split("@@MEASURE", 1)[1]
    done = json.loads(text.split("@@DONE ", 1)[1].splitlines()[0])
    return {**step_summary(iterations(text.split("@@DONE", 1)[0]), done["wall_s"], done["tokens"]),
            "cpu_ms_per_token": cpu_by_role(snaps[0], snaps[1], "main (vllm.LLM)", done["tokens"])}


def run_server(model: str, spec: dict | None, prompts_path: Path, num_prompts: int, output_len: int,
               env: dict, work: Path, label: str) -> dict[str, Any]:
    from benchmarks.vllm_bench_serve import run_client
    from diffspec.serving import ServerProcess, free_port, vllm_server_command

    port = free_port()
    extra = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--seed", "0",
             "--max-model-len", "2048", "--served-model-name", "model", "--enable-logging-iteration-details"]
    if spec:
        extra += ["--speculative-config", json.dumps(spec)]
    log = work / f"{label}.server.log"
    with ServerProcess(vllm_server_command(model, port, *extra), port, env=env, log_path=log) as server:
        server.wait_ready(600)
        run_client(port, "model", model, prompts_path, 1, output_len, 1, work, f"{label}-warm")
        skip = len(iterations(log.read_text()))
        before = process_cpu([server.proc.pid])
        data = run_client(port, "model", model, prompts_path, num_prompts + 1, output_len, 1, work, label)
        after = process_cpu([server.proc.pid])
        its = iterations(log.read_text())[skip:]
    # the client's first request repeats the warm-up prompt: drop its steps and its time
    first = next(i for i, (c, _, _) in enumerate(its[1:], 1) if c > 0)
    wall = sum(data["latencies"][1:])  # per request, end to end, as the client measured it
    tokens = output_len * num_prompts  # --ignore-eos: every request generates output_len tokens
    out = step_summary(its[first:], wall, tokens)
    # the CPU window spans the client's whole run, the repeated warm-up prompt included
    out["cpu_ms_per_token"] = cpu_by_role(before, after, "API server", output_len * (num_prompts + 1))
    out["client_tpot_ms"] = data.get("mean_tpot_ms")
    out["acceptance_length"] = data.get("spec_decode_acceptance_length")
    return out


def parse_baseline(text: str) -> tuple[str, dict | None]:
    """``ar`` | ``METHOD`` (diffspec's default: adaptive) | ``METHOD:K`` (fixed K)."""
    if text == "ar":
        return text, None
    method, _, k = text.partition(":")
    if not k:
        return text, {"method": method}
    return text, {"method": method, "num_speculative_tokens": int(k), "adaptive": False}


def table(rows: list[dict]) -> list[str]:
    lines = ["| layout | baseline | path | tok/s (rounds) | x AR | ms / token | decode step ms | tokens / step "
             "| inside steps | CPU ms / token: engine core / worker / frontend |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["layout"], r["baseline"], r["path"]) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    for layout, baseline, path in keys:
        cells = [r for r in rows if (r["layout"], r["baseline"], r["path"]) == (layout, baseline, path)]
        ratios = []
        for r in cells:
            ar = [a for a in rows if (a["layout"], a["baseline"], a["path"], a["round"])
                  == (layout, "ar", path, r["round"])]
            if ar:
                ratios.append(r["tok_per_s"] / ar[0]["tok_per_s"])
        med = statistics.median

        def m(key, cells=cells):
            return med(c[key] for c in cells if c.get(key) is not None)
        cpu = {k: med(c["cpu_ms_per_token"].get(k, 0.0) for c in cells) for k in ("engine core", "worker")}
        front = med(sum(v for k, v in c["cpu_ms_per_token"].items() if k not in ("engine core", "worker"))
                    for c in cells)
        inside = m("inside_steps_s") / m("wall_s")
        lines.append(f"| {layout} | {baseline} | {path} | {m('tok_per_s'):.2f} ("
                     + ", ".join(f"{c['tok_per_s']:.2f}" for c in cells) + ") | "
                     + (f"{med(ratios):.2f}" if ratios else "n/a")
                     + f" | {m('ms_per_token'):.1f} | {m('decode_step_ms'):.1f} | {m('tokens_per_step'):.2f} | "
                     f"{100 * inside:.0f}% | {cpu['engine core']:.1f} / {cpu['worker']:.1f} / {front:.1f} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = verb_parser("server-vs-offline", __doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, type=Path, help="JSONL rows with 'prompt'")
    p.add_argument("--baselines", default="ar,orthrus:3",
                   help="ar, METHOD (diffspec's default: adaptive) or METHOD:K (fixed K)")
    p.add_argument("--num-prompts", type=int, default=3, help="measured prompts (after one warm-up prompt)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", default="default", help="default, all-cores (comma-separated)")
    p.add_argument("--paths", default="offline,server")
    p.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--offline-worker"]:
        offline_worker(argv[1])
        return 0
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(args.model, args.prompts, args.num_prompts)
    rows: list[dict] = []
    for rnd in range(args.rounds):
        for layout in args.layouts.split(","):
            env = layout_env(layout)
            for text in args.baselines.split(","):
                baseline, spec = parse_baseline(text)
                for path in args.paths.split(","):
                    label = f"r{rnd}-{layout}-{baseline.replace(':', '-')}-{path}"
                    t0 = time.time()
                    if path == "offline":
                        r = run_offline(args.model, spec, prompts, args.output_len, env, args.out, label)
                    else:
                        r = run_server(args.model, spec, args.prompts, args.num_prompts, args.output_len,
                                       env, args.out, label)
                    rows.append({"round": rnd, "layout": layout, "baseline": baseline, "path": path, **r})
                    print(f"[server-vs-offline] {label}: {r['tok_per_s']:.2f} tok/s, decode step "
                          f"{r['decode_step_ms']:.1f} ms, {r['tokens_per_step']:.2f} tokens/step, "
                          f"CPU ms/token {r['cpu_ms_per_token']} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    meta = {"command": command_line("server-vs-offline", argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "nproc": os.cpu_count(),
            "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), "?")}
    lines = table(rows)
    (args.out / "server_vs_offline.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (args.out / "server_vs_offline.md").write_text(f"`{meta['command']}` ({meta['date']}, {meta['cpu']}, "
                                                   f"{meta['nproc']} cores)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
