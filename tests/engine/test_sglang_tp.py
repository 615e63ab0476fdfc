"""Engine tier: ORTHRUS and LINEAR_SELF_SPEC under tensor parallelism in a real SGLang
0.5.23 on its CPU path (``tp_size=2``, fp32, torch-native attention).

SGLang starts one scheduler process per rank; on a CPU without AMX (and not arm64) its
collectives go through torch.distributed's gloo backend. Each rank runs the diffusion view
on its own heads and its own KV pool; the view sums the row-parallel outputs that SGLang
leaves to the layer's stage boundaries (``o_proj`` / Orthrus ``o_proj_diff`` / NLD
``o_proj`` + LoRA, ``down_proj``), the LoRA loads sharded like ``o_proj``, and the draft
logits are the LM head's vocabulary shards, all-gathered. The check: the bundled trained tiny
checkpoints (4 query / 2 KV heads, so each rank holds 2 / 1), one mixed-length greedy
batch, TP=2 self-speculative output == TP=1 AR output token for token, with the drafts
accepted in runs (a wrong reduce or gather drafts garbage, which only lowers acceptance).
"""

from __future__ import annotations

import json
import os

import pytest

from diffspec.assets import ASSETS_DIR
from tests.engine.common import assert_equals_ar
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MODELS = {"orthrus": (ASSETS_DIR / "synth-orthrus", "ORTHRUS"),
          "nld": (ASSETS_DIR / "synth-nld", "LINEAR_SELF_SPEC")}
SYNC = {"disable_overlap_schedule": True}  # as the speculative runs
# SGLang's CUDA wheel (what the harness runs on CPU) finds NCCL next to its torch and then
# binds the communicator to a CUDA device, which fails for device "cpu"; a CPU install
# (torch+cpu) has no NCCL and SGLang skips it. Naming a library that does not exist makes
# the wheel do the same: the TP groups use gloo only.
NO_NCCL = "/nonexistent/libnccl.so.2"


def _requests() -> list[dict]:
    """Greedy prompts of the synthetic language (mixed lengths), budgets ending mid-block."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    texts = [*sample_prompts(3, seed=77), *sample_prompts(1, seed=78, num_phrases=(12, 14))]
    prompts = [tokenizer(t).input_ids for t in texts]  # ~40 tokens, one ~120
    return [{"input_ids": p, "max_new_tokens": m} for p, m in zip(prompts, (40, 23, 57, 30))]


def _cpu_bind(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` value: one allowed core per rank (shared when the
    machine has fewer); SGLang's default binding needs one NUMA node per rank."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per family, a TP=1 AR run and a TP=2 self-speculative run, in one subprocess."""
    batch = {"greedy": _requests()}
    runs = []
    for family, (path, algorithm) in MODELS.items():
        runs.append({"name": f"{family}_ar", "model": str(path), "engine": SYNC,
                     "batches": batch})
        # a fixed draft count (the checkpoint's block), not the adaptive default: the
        # acceptance below checks the sharded drafter, whatever the load
        runs.append({"name": f"{family}_tp2", "model": str(path), "batches": batch, "engine": {
            "tp_size": 2, "speculative_algorithm": algorithm, "decode_log_interval": 1,
            # (adaptive false: no prompt lookup either, the sharded drafter every step)
            "json_model_override_args": json.dumps({"diffspec": {"adaptive": False}})}})
    return run_generate_job({"runs": runs}, tmp_path_factory.mktemp("sglang_tp"),
                            env={"SGLANG_CPU_OMP_THREADS_BIND": _cpu_bind(2),
                                 "SGLANG_NCCL_SO_PATH": NO_NCCL})["runs"]


@pytest.mark.parametrize("family", list(MODELS))
def test_tp2_self_spec_greedy_equals_tp1_ar(engine, family: str) -> None:
    spec = engine[f"{family}_tp2"]["greedy"]
    assert_equals_ar(engine[f"{family}_ar"]["greedy"], spec)
    verify_steps = sum(m["spec_verify_ct"] for m in spec["meta"])
    generated = sum(len(o) for o in spec["outputs"])
    assert generated / verify_steps > 2  # the sharded drafter's drafts are accepted in runs
