"""Engine tier: self-speculation in a real SGLang (CPU path, fp32) with
``--attention-backend triton``, a backend SGLang users pick on a GPU: its
``TritonAttnBackend`` and its extend / decode Triton kernels run by Triton's interpreter on
CPU (``TRITON_INTERPRET=1`` in the harness :mod:`tests.engine.sglang_cpu`'s environment;
without it SGLang fails at the first kernel: no active Triton driver).

On triton the ORTHRUS and LINEAR_SELF_SPEC worker runs both passes of a step as SGLang
TARGET_VERIFY forwards with a custom mask (``NgramVerifyInput``: causal within the block
for the verify, the whole block visible for the draft), the layout of SGLang's GPU
backends, not the torch-native decode rows the other SGLang engine tests run; TIDAR runs
its branches in the verify forward with one token per page. Four engines (the bundled
trained ``synth-orthrus``, ``synth-nld``, ``synth-tidar``): Orthrus AR and ORTHRUS,
LINEAR_SELF_SPEC and TIDAR at a fixed width (Orthrus / NLD: 8, TiDAR: its default 9), on one
batch of mixed prompt lengths (one of random tokens), ``max_new_tokens`` ending mid-block:

* ORTHRUS: tokens and finish reasons equal AR's on triton; every request speculated;
  LINEAR_SELF_SPEC and TIDAR: tokens equal the reference decoder's AR;
* ORTHRUS and LINEAR_SELF_SPEC: each request's steps accept what the reference decoder
  accepts with the same blocks, so the draft's non-causal mask and the verify's causal one
  ran right in the kernels;
* FastDLLM in SGLang's dLLM mode (the trained tiny LLaDA; a fifth engine, refused on triton
  until it ran here): tokens and finish reasons equal the reference decoder's;
* ReFusion (the trained tiny ReFusion, its ragged causal DLLM_EXTEND forwards; a sixth
  engine, refused on triton until it ran here): tokens, finish reasons and the tokens its
  forwards processed equal the reference decoder's;
* bf16: ORTHRUS, LINEAR_SELF_SPEC and TIDAR each beside SGLang's AR in bf16 (six engines
  more), match rates reported, not asserted; each AR against the reference decoder's bf16 AR
  (the harness emulates bf16 arithmetic, which Triton's interpreter runs on bit patterns);
* SGLang resolved every launch to the triton backend.

The interpreter is slow: few requests, few tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffspec.assets import (
    SYNTH_DLLM_DIR,
    SYNTH_NLD_DIR,
    SYNTH_ORTHRUS_DIR,
    SYNTH_REFUSION_DIR,
    SYNTH_TIDAR_DIR,
)
from tests.engine.common import report_bf16_match, verify_steps
from tests.engine.conftest import require_sglang
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

WIDTH = 8
TRITON = {"attention_backend": "triton", "disable_overlap_schedule": True}
LLADA = SYNTH_DLLM_DIR / "llada"
FAST_DLLM_YAML = "threshold: 0.9\nblock_size: 8\n"  # test_sglang_fast_dllm's run llada_t09
REFUSION_RUN = "synth_s8_all"  # test_sglang_refusion's run: slots of 8, all planned
FIXED = {"json_model_override_args": json.dumps({"diffspec": {"adaptive": False}})}
SPEC = {**TRITON, **FIXED, "speculative_algorithm": "ORTHRUS",
        "speculative_num_draft_tokens": WIDTH}
NLD_SPEC = {**SPEC, "speculative_algorithm": "LINEAR_SELF_SPEC"}
# synth-tidar's default width (anchor + 8 shifted drafts); room for the branch rows
TIDAR_SPEC = {**TRITON, **FIXED, "speculative_algorithm": "TIDAR", "max_total_tokens": 32768}


# ORTHRUS and LINEAR_SELF_SPEC (the two-pass worker's custom masks) and TIDAR (its branch
# rows), each beside SGLang's AR on the same checkpoint, in bf16 on triton
MODELS = {"orthrus": SYNTH_ORTHRUS_DIR, "nld": SYNTH_NLD_DIR, "tidar": SYNTH_TIDAR_DIR}
BF16_RUNS = tuple((family, MODELS[family], spec)
                  for family, spec in (("orthrus", SPEC), ("nld", NLD_SPEC), ("tidar", TIDAR_SPEC)))


def _requests() -> list[dict]:
    """Mixed prompt lengths (9, 36, 30 random tokens, 81), max_new_tokens none a multiple
    of the 8-token step."""
    import numpy as np

    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(4, seed=1234)]
    noise = np.random.default_rng(7).integers(20, 200, 30).tolist()
    prompts = [prompts[0][:9], prompts[1], noise, prompts[2] + prompts[3]]
    return [{"input_ids": p, "max_new_tokens": m} for p, m in zip(prompts, (21, 13, 19, 17))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_sglang()
    from tests.engine.test_sglang_fast_dllm import _yaml

    tmp = tmp_path_factory.mktemp("sglang_triton")
    model = str(SYNTH_ORTHRUS_DIR)
    fast_dllm = {"attention_backend": "triton", "max_running_requests": 8, "dllm_fdfo": True,
                 "dllm_algorithm": "FastDLLM",
                 "dllm_algorithm_config": _yaml(tmp, "llada", FAST_DLLM_YAML)}
    from tests.engine.test_sglang_refusion import RUNS as REFUSION_RUNS
    from tests.engine.test_sglang_refusion import _yaml as refusion_yaml

    refusion = {"attention_backend": "triton", "max_running_requests": 12,
                "dllm_algorithm": "ReFusion", "dllm_algorithm_config": refusion_yaml(
                    tmp, REFUSION_RUN, REFUSION_RUNS[REFUSION_RUN][1])}
    job = {"runs": [{"name": "ar", "model": model, "engine": TRITON,
                     "batches": {"greedy": _requests()}},
                    {"name": "spec", "model": model, "engine": SPEC,
                     "batches": {"greedy": _requests()}},
                    {"name": "nld_spec", "model": str(SYNTH_NLD_DIR), "engine": NLD_SPEC,
                     "batches": {"greedy": _requests()}},
                    {"name": "tidar_spec", "model": str(SYNTH_TIDAR_DIR), "engine": TIDAR_SPEC,
                     "batches": {"greedy": _requests()}},
                    {"name": "fast_dllm", "model": str(LLADA), "engine": fast_dllm,
                     "batches": {"greedy": _fast_dllm_requests()}},
                    {"name": "refusion", "model": str(SYNTH_REFUSION_DIR),
                     "count_forwards": True, "engine": refusion,
                     "batches": {"batch": _refusion_requests()}}]}
    for name, path, spec in BF16_RUNS:  # bf16: match rates reported, not asserted
        job["runs"] += [{"name": f"{name}_ar_bf16", "model": str(path),
                         "engine": {**TRITON, "dtype": "bfloat16"},
                         "batches": {"greedy": _requests()}},
                        {"name": f"{name}_spec_bf16", "model": str(path),
                         "engine": {**spec, "dtype": "bfloat16"},
                         "batches": {"greedy": _requests()}}]
    return run_generate_job(job, tmp, timeout=1800, env={"TRITON_INTERPRET": "1"})


def _refusion_requests() -> list[dict]:
    from tests.engine.test_sglang_refusion import _requests

    return _requests(REFUSION_RUN, SYNTH_REFUSION_DIR)


def _fast_dllm_requests() -> list[dict]:
    from tests.engine.test_sglang_fast_dllm import _greedy_requests

    return _greedy_requests(LLADA)[:4]


def test_the_launch_ran_on_triton(engine) -> None:
    assert {run: info["attention_backend"] for run, info in engine["server_info"].items()} \
        == dict.fromkeys(("ar", "spec", "nld_spec", "tidar_spec", "fast_dllm", "refusion",
                          *(f"{name}_{kind}_bf16" for name, _, _ in BF16_RUNS
                            for kind in ("ar", "spec"))), "triton")


def test_orthrus_greedy_equals_ar_on_triton(engine) -> None:
    ar, spec = engine["runs"]["ar"]["greedy"], engine["runs"]["spec"]["greedy"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    assert all(verify_steps(spec)), verify_steps(spec)


def test_orthrus_acceptance_per_step_equals_reference_decoder(engine) -> None:
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import BlockDrafter
    from tests.engine.test_sglang_two_pass import _accepted_drafts_per_step

    accepted = _accepted_drafts_per_step(load_orthrus(SYNTH_ORTHRUS_DIR), BlockDrafter,
                                         Path(SYNTH_ORTHRUS_DIR), _requests(),
                                         engine["runs"]["spec"]["greedy"], width=WIDTH)
    assert 0 < sum(accepted) < (WIDTH - 1) * len(accepted)  # accepted runs and rejections


@pytest.mark.parametrize(("run", "path"), [("nld_spec", SYNTH_NLD_DIR),
                                           ("tidar_spec", SYNTH_TIDAR_DIR)])
def test_nld_and_tidar_greedy_equal_ar_on_triton(engine, run: str, path: Path) -> None:
    """LINEAR_SELF_SPEC (the two-pass worker, LoRA drafts) and TIDAR (its branches in the
    verify forward, one token per page): tokens equal the reference decoder's AR (equal to
    SGLang's AR in the other SGLang engine tests), every request that outlives a step
    speculated."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, ar_generate
    from tests.engine.common import load_self_spec_reference

    family = run.split("_")[0]
    model = load_self_spec_reference(family, path)
    stop = inspect_checkpoint(path).eos_token_ids
    refs = ar_generate(model.lm, [Request(r["input_ids"], r["max_new_tokens"],
                                          stop_token_ids=stop) for r in _requests()])
    spec = engine["runs"][run]["greedy"]
    assert spec["outputs"] == [r.token_ids for r in refs]
    assert all(n for n, out in zip(verify_steps(spec), spec["outputs"]) if len(out) > WIDTH)
    if family == "nld":
        from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
        from tests.engine.test_sglang_two_pass import _accepted_drafts_per_step

        # requests that ran steps (synth-nld ends the random prompt at the prefill's EOS)
        ran = [i for i, out in enumerate(spec["outputs"]) if len(out) > 1]
        stepped = {k: [spec[k][i] for i in ran] for k in ("outputs", "meta", "finish_reasons")}
        accepted = _accepted_drafts_per_step(model, LinearSelfSpecDrafter, Path(path),
                                             [_requests()[i] for i in ran], stepped,
                                             width=WIDTH)
        assert 0 < sum(accepted) < (WIDTH - 1) * len(accepted)


def test_fast_dllm_on_triton_equals_reference(engine) -> None:
    """FastDLLM in SGLang's dLLM mode on triton (its block forwards: DLLM_EXTEND over each
    request's block on the paged prefix), the trained tiny LLaDA, mixed prompt lengths,
    continuous batching: token for token the reference decoder's with the same layout."""
    from tests.engine.test_sglang_fast_dllm import _reference

    got = engine["runs"]["fast_dllm"]["greedy"]
    ref = _reference("llada_t09", LLADA, _fast_dllm_requests())
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["finish_reasons"] == [o.finish_reason for o in ref]
    assert any(max(o.accept_lengths) > 1 for o in ref)  # slots committed in parallel


def test_refusion_on_triton_equals_reference(engine) -> None:
    """ReFusion in SGLang's dLLM mode on triton: the mixed-length batch of
    ``tests/engine/test_sglang_refusion.py`` (a stop token inside a slot), token for token
    the reference decoder's, its DLLM_EXTEND forwards processing the reference's tokens
    (each committed slot's KV written once, at its true positions)."""
    from tests.engine.test_sglang_refusion import _reference

    got = engine["runs"]["refusion"]["batch"]
    ref = _reference(REFUSION_RUN, SYNTH_REFUSION_DIR, _refusion_requests())
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["finish_reasons"] == [o.finish_reason for o in ref]
    assert "stop" in got["finish_reasons"]
    assert got["tokens"]["DLLM_EXTEND"] == sum(o.num_tokens for o in ref)


@pytest.mark.parametrize("family", [name for name, _, _ in BF16_RUNS])
def test_bf16_match_rate_report(engine, family: str, record_property, capsys) -> None:
    """bf16 on triton's kernels: the method beside SGLang's AR in bf16 on the same backend,
    match rate reported (:func:`~tests.engine.common.report_bf16_match`)."""
    spec = engine["runs"][f"{family}_spec_bf16"]["greedy"]
    steps = [n or 0 for n in verify_steps(spec)]  # none: a request that stopped at prefill
    # every verify step emits one token besides its accepted drafts (the prefill one more)
    accepted = sum(len(out) for out in spec["outputs"]) - sum(steps) - len(spec["outputs"])
    with capsys.disabled():
        report_bf16_match(f"SGLang triton {family}", family, MODELS[family],
                          [(r["input_ids"], r["max_new_tokens"]) for r in _requests()],
                          engine["runs"][f"{family}_ar_bf16"]["greedy"], spec, accepted,
                          record_property)
    assert sum(steps) > 0
