"""Orthrus on the bundled synth-orthrus: vLLM (its own counters) next to the reference decoder.

    python -m benchmarks vllm-vs-reference [--prompts 16] [--max-tokens 64]

Runs the same greedy requests through the reference decoder (BlockDrafter, 31 drafts per
step), through vLLM with ``{"method": "orthrus", "num_speculative_tokens": 31}`` and through
vLLM's plain AR, then prints acceptance length, TPF and whether all three outputs agree.
Needs vLLM installed (bash scripts/bootstrap.sh). Acceptance length = tokens emitted per
verify step; TPF = generated tokens / forwards after the prompt's prefill (a draft + verify
step is two forwards; vLLM's first token comes out of its prefill forward, so it is left out
of vLLM's count).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import verb_parser  # here: the file also runs as a script

    parser = verb_parser("vllm-vs-reference", __doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234, help="synthetic prompt seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from diffspec.assets import SYNTH_ORTHRUS_DIR
    from diffspec.core.sampling import SamplingParams
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import BlockDrafter, Request, speculative_generate
    from diffspec.testing.synthetic import sample_prompts

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(SYNTH_ORTHRUS_DIR))
    model = load_orthrus(SYNTH_ORTHRUS_DIR)
    prompts = [tokenizer(p)["input_ids"] for p in sample_prompts(args.prompts, args.seed)]
    stops = list(model.eos_token_ids)
    requests = [Request(p, max_tokens=args.max_tokens, sampling=SamplingParams(),
                        stop_token_ids=tuple(stops)) for p in prompts]
    ref = speculative_generate(model.lm, BlockDrafter(model), requests, 31)

    spec = {"method": "orthrus", "num_speculative_tokens": 31, "adaptive": False}
    job = {"runs": [
        {"name": "orthrus", "llm": {"speculative_config": spec, "disable_log_stats": False,
                                    "per_request_spec_decode_metrics": "detailed"}},
        {"name": "ar", "llm": {}},
    ]}
    with tempfile.TemporaryDirectory() as tmp:
        req_file, job_file = Path(tmp) / "requests.json", Path(tmp) / "job.json"
        req_file.write_text(json.dumps([{"prompt_token_ids": p, "max_tokens": args.max_tokens,
                                         "stop_token_ids": stops} for p in prompts]))
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, str(ROOT / "tests/engine/vllm_generate.py"),
                               str(SYNTH_ORTHRUS_DIR), str(req_file), str(job_file)],
                              capture_output=True, text=True, check=False)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("DIFFSPEC_RESULT ")]
    if not lines:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(lines[0][len("DIFFSPEC_RESULT "):])
    vllm_spec, vllm_ar = result["runs"]["orthrus"]["default"], result["runs"]["ar"]["default"]
    counters = result["metrics"]["orthrus"]["default"]

    ref_tokens = sum(len(o.token_ids) for o in ref)
    ref_steps = sum(len(o.accept_lengths) for o in ref)
    v_tokens = sum(len(o) for o in vllm_spec["outputs"])
    v_steps = counters["vllm:spec_decode_num_drafts"]
    v_accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    print(f"synth-orthrus, {args.prompts} prompts (seed {args.seed}), max {args.max_tokens} "
          f"tokens, greedy, fp32, vLLM {result['vllm_version']}")
    print("| decoder | tokens | verify steps | acceptance length | TPF |")
    print("|---|---|---|---|---|")
    print(f"| reference | {ref_tokens} | {ref_steps} | {ref_tokens / ref_steps:.2f} | "
          f"{ref_tokens / sum(o.num_forwards for o in ref):.2f} |")
    print(f"| vLLM | {v_tokens} | {v_steps} | {(v_accepted + v_steps) / v_steps:.2f} | "
          f"{(v_tokens - len(prompts)) / (2 * v_steps):.2f} |")
    same = vllm_spec["outputs"] == vllm_ar["outputs"] == [o.token_ids for o in ref]
    print(f"outputs: vLLM orthrus == vLLM AR == reference: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
