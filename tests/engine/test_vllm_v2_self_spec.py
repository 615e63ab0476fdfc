"""Engine tier: Orthrus, NLD linear and TiDAR self-speculation as speculators of vLLM's V2
model runner (``VLLM_USE_V2_MODEL_RUNNER=1``: patch ``v2_speculator`` builds
``diffspec.spec_workers.vllm.two_pass_v2.TwoPassSpeculator`` or
``diffspec.spec_workers.vllm.tidar_v2.TiDARSpeculator`` in the runner's
``init_speculator``), run in real vLLM on CPU through the test-only harness
:mod:`tests.engine.vllm_v2_cpu` (Triton's interpreter runs the runner's kernels).

One subprocess, three engines (the bundled trained ``synth-orthrus``, ``synth-nld`` and
``synth-tidar``, fp32, 7 drafts per step, KV blocks of 32 tokens): the V2 runner's own
scheduler, input preparation, sampler, rejection sampler and paged KV cache; the draft pass
(TiDAR: the branches inside the verify forward) reads that cache. The checks:

* greedy, one batch of mixed prompt lengths with ``max_tokens`` ending mid-block and one
  prompt prefilled in chunks while the others decode: tokens equal plain AR (the reference
  decoder, which ``tests/engine/test_vllm_v2_runner.py`` shows equal to vLLM's AR on both
  runners), every request speculated, and each verify step accepts what the reference
  speculative decoder (TiDAR: :mod:`diffspec.spec_workers.reference.tidar`) accepts with the
  same blocks (so the drafts are the diffusion view's, or the accepted branch's, over the
  right K/V);
* seeded sampling (the V2 runner's sampler, per-request seeds): the same seeded requests
  twice give the same samples, and a batch of one-token prompts passes a chi-square test
  against the exact AR sequence probabilities;
* the launches the V2 path refuses at engine-config time, each with what to do first:
  ``"adaptive": true``, prompt lookup, async scheduling;
* memory: no TiDAR forward runs more rows (scheduled tokens plus branches) than
  ``max_num_batched_tokens``, the rows vLLM's memory profile forwarded (its scheduler
  reserves each request's branch rows: patch ``drafting_rows``).

The interpreter is slow: few requests, few tokens; the one job takes about 3 minutes on the
2-core box (188 s with other jobs on it, of which the TiDAR run about 30 s): three engine
starts and a 60-request sampled batch.
"""

from __future__ import annotations

import pytest

from diffspec.assets import SYNTH_NLD_DIR, SYNTH_ORTHRUS_DIR, SYNTH_TIDAR_DIR
from tests.engine.common import (
    assert_clear_error,
    assert_samples_follow_the_model,
    load_self_spec_reference,
    v2_steps_compared,
    verify_steps,
)
from tests.engine.conftest import require_engine, skip_or_fail

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NUM_DRAFTS = 7
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 48, "probe_runner": True,
              "per_request_spec_decode_metrics": "detailed", "disable_log_stats": False}
# TiDAR reserves 8 x 7 branch rows per scheduled request (synth-tidar's drafts are shifted):
# two requests' full steps per forward, and the 83-token prompt still prefilled in chunks
TIDAR_BUDGET = 128
SPECULATORS = {"orthrus": "diffspec.spec_workers.vllm.two_pass_v2.TwoPassSpeculator",
               "nld": "diffspec.spec_workers.vllm.two_pass_v2.TwoPassSpeculator",
               "tidar": "diffspec.spec_workers.vllm.tidar_v2.TiDARSpeculator"}
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
MODELS = {"orthrus": SYNTH_ORTHRUS_DIR, "nld": SYNTH_NLD_DIR, "tidar": SYNTH_TIDAR_DIR}
# sampling: prompt [103] at temperature 0.5 on synth-orthrus: the prefill's token is 74,
# then the first verify step's tokens follow one of a few sequences (0.58, 0.23, 0.10, ...),
# so the chi-square test sees the rejection sampler's accept / resample outcomes. No top-k /
# top-p: vLLM's top-k / top-p Triton kernel does not run in Triton's interpreter (its
# ``tl.range`` index is a Python int there: "'int' object has no attribute 'to'"), a limit of
# the test harness, with or without speculation.
SAMPLED_PROMPT, TEMPERATURE, NUM_SEEDS, SAMPLED_TOKENS = [103], 0.5, 60, 3


def _greedy_requests() -> list[dict]:
    """Mixed prompt lengths; max_tokens none of them a multiple of the 8-token step; the
    last prompt (two synthetic prompts, 83 tokens) is prefilled in chunks of the 48-token
    budget while the others decode."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(5, seed=1234)]
    prompts = [prompts[0][:9], prompts[1], prompts[2][:20], prompts[3] + prompts[4]]
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, (21, 13, 30, 19))]


def _tidar_requests() -> list[dict]:
    """Two of :func:`_greedy_requests` (the trained model accepts every draft: the last
    branch each step; the second is prefilled in chunks) and two prompts of random tokens,
    on which it accepts 0 to 7 drafts a step (the other branches)."""
    import numpy as np

    greedy = _greedy_requests()
    rng = np.random.default_rng(7)
    noise = [{"prompt_token_ids": rng.integers(20, 200, n).tolist(), "max_tokens": m}
             for n, m in ((30, 26), (20, 30))]
    return [greedy[0], noise[0], noise[1], greedy[3]]


def _requests(family: str) -> list[dict]:
    return _tidar_requests() if family == "tidar" else _greedy_requests()


def _seeded_requests() -> list[dict]:
    return [{"prompt_token_ids": [5], "max_tokens": 12, "temperature": 1.0,
             "seed": 500 + i, "ignore_eos": True} for i in range(2)]


def _sampled_requests() -> list[dict]:
    return [{"prompt_token_ids": SAMPLED_PROMPT, "max_tokens": SAMPLED_TOKENS,
             "temperature": TEMPERATURE,
             "seed": seed, "ignore_eos": True} for seed in range(NUM_SEEDS)]


def _spec(method: str, **extra) -> dict:
    return {"speculative_config": {"method": method, "num_speculative_tokens": NUM_DRAFTS,
                                   **extra}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every V2 run of this module, in one subprocess under the harness."""
    require_engine("vllm")
    from tests.engine.vllm_v2_cpu import run_vllm_generate, triton_interpreter_missing

    why = triton_interpreter_missing()
    if why:
        skip_or_fail("vllm", why)
    orthrus = {"greedy": _greedy_requests(), "seeded": _seeded_requests(),
               "seeded_again": _seeded_requests(), "sampled": _sampled_requests()}
    job = {
        "runs": [
            {"name": "orthrus", "model": str(SYNTH_ORTHRUS_DIR),
             "llm": {**LLM_KWARGS, **_spec("orthrus")}, "batches": orthrus},
            {"name": "nld", "model": str(SYNTH_NLD_DIR),
             "llm": {**LLM_KWARGS, **_spec("linear_self_spec")},
             "batches": {"greedy": _greedy_requests()}},
            {"name": "tidar", "model": str(SYNTH_TIDAR_DIR),
             "llm": {**LLM_KWARGS, **_spec("tidar"), "max_num_batched_tokens": TIDAR_BUDGET,
                     "count_forwards": True},
             "batches": {"greedy": _tidar_requests()}},
        ],
        "config_errors": {
            "adaptive": _spec("orthrus", adaptive=True),
            "prompt_lookup": _spec("orthrus", prompt_lookup=True),
            "async_scheduling": {**_spec("orthrus"), "engine_args": {"async_scheduling": True}},
        },
    }
    return run_vllm_generate(SYNTH_ORTHRUS_DIR, [], tmp_path_factory.mktemp("vllm_v2_spec"),
                             job, v2=True, timeout=1500)


def test_the_v2_runner_drafted_with_diffspecs_speculator(engine) -> None:
    for family in MODELS:
        runner = engine["runs"][family]["greedy"]["runner"]
        assert V2_RUNNER in runner["classes"]
        assert runner["speculator"] == SPECULATORS[family]
        assert runner["draft_forwards"] > 0
        assert runner["kernels"]  # the V2 runner's Triton kernels ran


@pytest.mark.parametrize("family", list(MODELS))
def test_greedy_equals_ar(engine, family: str) -> None:
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    model = load_self_spec_reference(family, MODELS[family])
    stop = inspect_checkpoint(MODELS[family]).eos_token_ids
    spec = engine["runs"][family]["greedy"]
    refs = ar_generate(model.lm, [Request(r["prompt_token_ids"], r["max_tokens"],
                                          stop_token_ids=stop) for r in _requests(family)])
    assert spec["outputs"] == [r.token_ids for r in refs]
    assert all(verify_steps(spec)), verify_steps(spec)


@pytest.mark.parametrize("family", list(MODELS))
def test_acceptance_per_step_equals_reference_decoder(engine, family: str) -> None:
    """vLLM's first token comes from the prefill; from then on each verify step drafts the
    reference decoder's block on ``prompt + [first token]`` and accepts as many drafts, as
    long as the reference drafts a whole block (the V2 runner verifies its fixed 7 drafts
    up to ``max_tokens``, where the reference drafts fewer). TiDAR: vLLM's prefill is the
    reference's bootstrap step (it pre-drafts branch 0 after the prompt), and each later
    step verifies the branch the previous one's acceptance selected. The trained
    checkpoints' drafts are accepted in runs."""
    from diffspec.core.checkpoint import inspect_checkpoint

    model = load_self_spec_reference(family, MODELS[family])
    stop = inspect_checkpoint(MODELS[family]).eos_token_ids
    spec = engine["runs"][family]["greedy"]
    compared = 0
    for request, out, steps in zip(_requests(family), spec["outputs"], spec["spec_steps"]):
        compared += v2_steps_compared(family, model, request, out, steps, stop, NUM_DRAFTS)
    assert compared >= 4
    accepted = [a for steps in spec["spec_steps"] for a in steps]
    assert sum(accepted) / len(accepted) > 2
    if family == "tidar":  # the first, the last and a middle branch were each selected
        assert {0, NUM_DRAFTS} < set(accepted), accepted


def test_tidar_forwards_stay_within_the_profiled_rows(engine) -> None:
    """Without the reservation the 4 requests' steps would forward up to 4 x (8 + 56) rows
    (twice the budget); with it no forward (metered on the model's first layer) runs more
    than ``max_num_batched_tokens``."""
    rows = engine["runs"]["tidar"]["greedy"]["forwards"]["max_rows"]
    assert TIDAR_BUDGET // 2 < rows <= TIDAR_BUDGET, rows


def test_seeded_sampling_is_reproducible(engine) -> None:
    runs = engine["runs"]["orthrus"]
    assert runs["seeded"]["outputs"] == runs["seeded_again"]["outputs"]
    assert runs["seeded"]["outputs"][0] != runs["seeded"]["outputs"][1]  # really sampled
    assert all(verify_steps(runs["seeded"]))


def test_seeded_sampling_matches_the_ar_distribution(engine) -> None:
    run = engine["runs"]["orthrus"]["sampled"]
    samples = [tuple(o) for o in run["outputs"]]
    assert all(verify_steps(run))
    accepted = [a for steps in run["spec_steps"] for a in steps]
    assert 0 < sum(accepted) < len(accepted) * (SAMPLED_TOKENS - 1)  # accepts and rejects
    assert len(set(samples)) > 2
    assert_samples_follow_the_model(load_self_spec_reference("orthrus", MODELS["orthrus"]).lm,
                                    SAMPLED_PROMPT, {"spec": samples}, TEMPERATURE, NUM_SEEDS)


@pytest.mark.parametrize(("case", "match"), [
    ("adaptive", r"^\w+: set \"adaptive\": false \(or leave it out\) and remove "
                 r"\"latency_profile\" for method 'orthrus' on vLLM's V2 model runner"),
    ("prompt_lookup", r"^\w+: remove \"prompt_lookup\" \(or set it false\) for method "
                      r"'orthrus' on vLLM's V2 model runner"),
    ("async_scheduling", r"^\w+: add --no-async-scheduling \(or leave it out\) for method "
                         r"'orthrus' on vLLM's V2 model runner"),
])
def test_v2_refusals(engine, case: str, match: str) -> None:
    assert_clear_error(engine["config_errors"], case, match)


def test_tidar_refuses_split_kernel_block_tables() -> None:
    """Where the attention backend splits the KV blocks into smaller kernel blocks, vLLM maps
    the block tables into one buffer per attention group, which TiDAR's branch metadata
    (built before the verify runs) would overwrite: refused when the V2 runner hands the
    speculator its attention groups. No engine start: the runner's call, with its groups."""
    from types import SimpleNamespace

    require_engine("vllm")
    from diffspec.spec_workers.vllm.tidar_v2 import TiDARSpeculator

    group = SimpleNamespace(kernel_block_size=16, kv_cache_spec=SimpleNamespace(block_size=32),
                            backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))
    with pytest.raises(RuntimeError, match=r"^set --block-size 16 \(a block size the attention "
                                           r"backend FLASH_ATTN runs as it is\) for method "
                                           r"'tidar' on vLLM's V2 model runner: "):
        TiDARSpeculator.set_attn(SimpleNamespace(), None, None, None, None, [[group]])

