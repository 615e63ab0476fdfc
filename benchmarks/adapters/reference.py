"""Reference-decoder adapter: diffspec's engine-free decoder, in-process, one request at a
time (so only concurrency 1). Forwards and acceptance come from its exact step counts."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.baselines import Baseline
from benchmarks.metrics import Completion, RunResult


def run(spec: Baseline, model: str | Path, prompts: list[list[int]], max_tokens: int,
        ignore_eos: bool = False, threads: int = 1,
        options: dict | None = None) -> RunResult:
    """Decode ``prompts`` (token ids) greedily with method ``spec.method`` of the CLI's
    table, on ``threads`` torch CPU threads (1: tiny models on a shared 2-core machine are
    fastest and steadiest on one; two threads contend with every other process);
    ``options``: more ``load_decoder`` options (Fast-dLLM's ``attention``)."""
    import torch

    from diffspec.methods import get_method
    from diffspec.spec_workers.reference import load_decoder
    from diffspec.spec_workers.reference.decoder import Request

    baseline, num_draft_tokens = spec.method, max(1, spec.num_draft_tokens)
    torch.set_num_threads(threads)
    takes_k = "num_draft_tokens" in get_method(baseline).defaults
    decoder = load_decoder(baseline, model,
                           **({"num_draft_tokens": num_draft_tokens} if takes_k else {}),
                           **(options or {}))
    stops = () if ignore_eos else decoder.stop_token_ids
    decoder.decode([Request(prompts[0], max_tokens=8, stop_token_ids=stops)])  # warm-up, untimed
    completions, accepted_per_pos = [], [0] * num_draft_tokens
    for ids in prompts:
        request = Request(ids, max_tokens=max_tokens, stop_token_ids=stops)
        start = time.perf_counter()
        [out] = decoder.decode([request])
        latency = time.perf_counter() - start
        steps = len(out.accept_lengths) if baseline != "ar" else 0
        completions.append(Completion(
            token_ids=list(out.token_ids), latency_s=latency, drafts=steps,
            draft_tokens=out.num_draft_tokens,
            accepted=sum(out.accept_lengths) - steps if steps else 0,
            forwards=out.num_forwards))
        for length in out.accept_lengths if baseline != "ar" else []:
            for pos in range(min(length - 1, num_draft_tokens)):  # accepted drafts of a step
                accepted_per_pos[pos] += 1
    latency = sum(c.latency_s for c in completions)
    tokens = sum(len(c.token_ids) for c in completions)
    return RunResult(
        engine="reference", baseline=spec.label,
        launch={"decoder": "diffspec.spec_workers.reference.load_decoder", "method": baseline,
                "model": str(model), **dict(decoder.options), "dtype": "float32", "greedy": True,
                "ignore_eos": ignore_eos, "torch_threads": threads},
        completions=completions,
        system_tokens_per_s={1: tokens / latency if latency > 0 else 0.0},
        accepted_per_pos=accepted_per_pos if baseline != "ar" else [],
        forwards_per_step=spec.forwards_per_step,
        notes=[("reference decoder: requests decoded one after the other (concurrency 1 only), "
               "after an untimed 8-token warm-up; "
               "acceptance length = mean tokens committed per step, from its step log")],
    )

