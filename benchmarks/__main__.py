"""``python -m benchmarks VERB [ARGS]``: every benchmark behind one command.

Each verb runs one module's ``main(argv)`` unchanged (``python -m benchmarks VERB --help``: its
options); the modules' own ``python -m benchmarks.MODULE`` forms keep working. ``drafters``
runs the stages of ``benchmarks/smollm2_drafters.sh`` (a shell pipeline driven by environment
variables: ``PY``, ``RUNS``, ``CPU_MINUTES``, ...).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ENTRY

HERE = Path(__file__).resolve().parent
DRAFTERS_SCRIPT = HERE / "smollm2_drafters.sh"


@dataclass(frozen=True)
class Verb:
    module: str  # benchmarks.<module>, whose main(argv) runs; "" for the drafters script
    summary: str  # the one line `--help` lists


VERBS: dict[str, Verb] = {
    "driver": Verb("driver", "a prompt set, every baseline on every engine, one report"),
    "serve-tables": Verb("serve_tables", "per prompt set: vLLM's server and offline, resumable"),
    "sweep": Verb("adaptive_sweep", "AR / fixed K / adaptive over a concurrency sweep"),
    "load-faults": Verb("load_faults", "load and faults: a method's server against AR's"),
    "bench-serve": Verb("vllm_bench_serve", "the baselines through `vllm bench serve`"),
    "server-vs-offline": Verb("server_vs_offline", "a step's time: vLLM's server vs vllm.LLM"),
    "step-vs-context": Verb("step_vs_context", "step time against context length"),
    "code-ab": Verb("code_ab", "two diffspec checkouts, rounds interleaved: is it faster"),
    "compare": Verb("compare", "driver reports side by side, ratios to AR"),
    "drafter-curves": Verb("drafter_curves", "two drafters' acceptance against CPU-minutes"),
    "acceptance-curve": Verb("acceptance_curve", "Orthrus heads' acceptance vs training tokens"),
    "profile-forward": Verb("profile_forward", "forward latency by query tokens and context"),
    "vllm-vs-reference": Verb("orthrus_vllm_vs_reference", "Orthrus: vLLM vs reference decoder"),
    "tiny-drafters": Verb("tiny_drafters", "untrained EAGLE-3 / DFlash for the tiny models"),
    "drafters": Verb("", "the embedded default's drafters: smollm2_drafters.sh stages"),
}


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, VERBS)) + 2
    verbs = "\n".join(f"  {name:<{width}}{verb.summary}" for name, verb in VERBS.items())
    p = argparse.ArgumentParser(prog=ENTRY, description=__doc__, epilog=f"verbs:\n{verbs}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", metavar="VERB", choices=VERBS, help="one of the verbs below")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the verb's own (VERB --help)")
    return p


def drafters_help() -> str:
    """The script's header comment: its stages and environment variables."""
    lines = DRAFTERS_SCRIPT.read_text().splitlines()[1:]
    head = [line[2:] if line.startswith("# ") else line[1:]
            for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]]
    return f"usage: {ENTRY} drafters STAGE [STAGE ...]\n\n" + "\n".join(head) + "\n"


def run_drafters(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(drafters_help(), end="")
        return 0 if argv else 2
    return subprocess.run(["bash", str(DRAFTERS_SCRIPT), *argv], check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser().print_help()
        return 2
    if argv[0] not in VERBS:
        build_parser().parse_args(argv)  # -h: the verbs (exit 0); else an error naming them
        return 2
    verb = VERBS[argv[0]]
    if not verb.module:
        return run_drafters(argv[1:])
    result = importlib.import_module(f"benchmarks.{verb.module}").main(argv[1:])
    return result if isinstance(result, int) else 0  # driver / profile_forward return reports


if __name__ == "__main__":
    raise SystemExit(main())
