"""Engine tier: TiDAR / NLD quadratic self-speculation (``--speculative-algorithm TIDAR``)
served by a real SGLang 0.5.23 on its CPU path (fp32, torch-native attention).

One ``sglang_generate.py`` subprocess runs every engine of this module one after the other
(the trained tiny TiDAR ``synth-tidar`` under AR and ``TIDAR``, a tiny random NLD checkpoint
in its real layout under AR and ``TIDAR``) and builds server arguments that must fail. The
checks:

* greedy, one batch of mixed-length prompts, ``max_new_tokens`` ending mid-block, an EOS
  inside a block: ``TIDAR`` output equals SGLang's own AR output token for token
  (continuous batching: requests join and leave the running batch at different steps);
* radix cache: a request whose prompt extends an earlier one by 90 of its generated tokens
  hits the cache over K/V that quadratic steps committed, and still decodes as AR;
* acceptance: each request's accepted drafts per step equal the reference decoder's
  (:func:`diffspec.spec_workers.reference.tidar.tidar_generate`) on the same checkpoint;
* one forward per step: SGLang's model forwards, counted inside its scheduler process, are
  one prefill (fused with the bootstrap branch) plus one ``TARGET_VERIFY`` per step, the
  reference's ``num_forwards``; several tokens come out of each forward;
* sampled requests follow the AR distribution (chi-square, like SGLang's own sampler);
* clear errors at server-argument time; ``avg_spec_accept_length`` in the server info;
* adaptive draft counts (``--json-model-override-args '{"diffspec": {"adaptive": true,
  ...}}'``) on a hand-built latency profile whose knee makes the policy draft less as the
  batch grows: output equals AR, and the Prometheus counters show plain AR steps and
  steps with drafts.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import SYNTH_TIDAR_DIR
from diffspec.profiling import CACHE_ENV
from tests.engine.common import (
    assert_clear_error,
    assert_equals_ar,
    assert_samples_follow_the_model,
    assert_sglang_logits_chunked,
    prefix_requests,
    set_eos_inside_a_block,
    sglang_tokens_per_verify_step,
)
from tests.engine.conftest import require_sglang
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SYNTH_WIDTH = 9  # synth-tidar: block_size 8, shifted drafts -> anchor + 8 drafts (default)
NLD_WIDTH = 8  # the tiny NLD (block_size 32, unshifted): anchor + 7 drafts, 8 masks a branch
# the default: adaptive drafting, priced by a profile the worker measures at start-up
DEFAULT = {"speculative_algorithm": "TIDAR", "decode_log_interval": 1, "max_total_tokens": 32768}
# a fixed draft count (every step the most), as the reference decoder's steps are compared at
SPEC = {**DEFAULT, "json_model_override_args": json.dumps({"diffspec": {"adaptive": False}})}
NLD_SPEC = {**SPEC, "speculative_num_draft_tokens": NLD_WIDTH}
# Sampling on the trained model: 4 tokens after a one-token prompt at T = 0.3, top-p 0.9 put
# about 70% of the mass on ~20 sequences (enough per chi-square cell), and its drafts are
# accepted at some steps and rejected at others.
TEMPERATURE, TOP_P, NUM_SAMPLES, SAMPLED_TOKENS = 0.3, 0.9, 300, 4
SINGLES = ("single_0", "single_1")  # requests served alone: forwards per step
# synth_spec computes its logits 16 rows at a time (one request's 9 verify rows per accept
# part): its batches (81 step rows per request) span many chunks; every lossless test on it
# checks the chunked path
LOGITS_ROWS = 16
# synth_spec's chunked prefill: SGLang's memory accounting then covers forwards of
# max(2048, chunk) = 2048 tokens, which 48 running requests' full steps (48 x 81) exceed
STEP_BUDGET = 2048
# flat up to 12 query tokens, then every token costs 9 flat steps: a TiDAR step with k drafts
# forwards (k + 1)^2 tokens per request (synth-tidar's drafts are shifted), so one request
# drafts 2, two or three 1 each, and of four or more only two draft (one each, per request)
# or none does (one count per step) (tests/unit/test_adaptive_tidar.py)
KNEE_PROFILE = {"points": {"1": 0.01, "12": 0.01, "13": 0.1}}


# ------------------------------------------------------------------------------ inputs


def _synth_prompts() -> list[list[int]]:
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(6, seed=1234)]
    lengths = (2, 9, 17, None, 25, None)  # mixed lengths: some prompts cut short
    return [p[:n] for p, n in zip(prompts, lengths)]


def _greedy_requests() -> list[dict]:
    max_tokens = (20, 45, 7, 50, 33, 61)  # none a multiple of the 9-token step
    return [{"input_ids": p, "max_new_tokens": m} for p, m in zip(_synth_prompts(), max_tokens)]


def _option_requests() -> list[dict]:
    """Greedy requests with per-request penalties / min_new_tokens / logit bias (applied
    on every verify row with the drafts before it: synth-tidar accepts long runs, so the
    rows' histories really differ from the step's start)."""
    greedy = _greedy_requests()
    return [{**greedy[3], "repetition_penalty": 1.3}, {**greedy[4], "frequency_penalty": 0.5},
            {**greedy[0], "presence_penalty": 0.8}, {**greedy[1], "min_new_tokens": 40},
            {**greedy[5], "logit_bias": {"20": 3.0, "21": -2.0}}]


def _refused_requests() -> list[dict]:
    greedy = _greedy_requests()
    return [greedy[0], {**greedy[1], "return_logprob": True}, greedy[2]]


def _nld_requests() -> list[dict]:
    rng = np.random.default_rng(7)
    lengths, max_tokens = (3, 9, 17, 70, 40), (20, 45, 7, 50, 33)
    return [{"input_ids": rng.integers(20, 250, n).tolist(), "max_new_tokens": m}
            for n, m in zip(lengths, max_tokens)]


def _sampling_prompt() -> list[int]:
    return [31]


def _sampled_requests() -> list[dict]:
    return [{"input_ids": _sampling_prompt(), "max_new_tokens": SAMPLED_TOKENS,
             "temperature": TEMPERATURE, "top_p": TOP_P, "ignore_eos": True}
            for _ in range(NUM_SAMPLES)]


def _ar_lm(path: Path):
    from diffspec.model_executors.reference.tidar import load_quadratic

    return load_quadratic(path).lm


def _near_context_end_requests() -> list[dict]:
    """A request that ends 7 tokens before synth-tidar's 512-token context: its last
    steps' branches reach past the context (their positions are clamped there)."""
    prompt = _synth_prompts()[3]
    return [{"input_ids": prompt, "max_new_tokens": 505 - len(prompt), "ignore_eos": True}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import write_nld, write_orthrus, write_qwen3

    root = tmp_path_factory.mktemp("sglang_tidar_ckpts")
    synth = root / "synth-tidar"
    shutil.copytree(SYNTH_TIDAR_DIR, synth)
    # a greedy request stops on an EOS inside a step
    request = _greedy_requests()[1]
    set_eos_inside_a_block(synth, _ar_lm(synth), request["input_ids"], request["max_new_tokens"])
    return {"synth": synth, "nld": write_nld(root / "nld"),
            "orthrus": write_orthrus(root / "orthrus"), "qwen3": write_qwen3(root / "qwen3")}


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every offline engine run of this module, in one subprocess."""
    require_sglang()
    # the reuse request's cached prefix is mostly K/V committed by quadratic steps
    prefix_seed, prefix_reuse = prefix_requests("sglang", _ar_lm(ckpts["synth"]),
                                                _synth_prompts()[3])
    greedy = _greedy_requests()
    batches = {"greedy": greedy, "prefix_seed": prefix_seed, "prefix_reuse": prefix_reuse,
               "sampled": _sampled_requests(), SINGLES[0]: [greedy[3]],
               SINGLES[1]: [greedy[5]], "near_context_end": _near_context_end_requests(),
               "options": _option_requests(), "refused": _refused_requests()}
    synth, nld = str(ckpts["synth"]), str(ckpts["nld"])
    tmp = tmp_path_factory.mktemp("sglang_tidar")
    profile = tmp / "knee-profile.json"
    profile.write_text(json.dumps(KNEE_PROFILE))
    adaptive = {**SPEC, "json_model_override_args": json.dumps(
        {"diffspec": {"adaptive": True, "latency_profile": str(profile)}})}
    job = {
        "runs": [
            {"name": "synth_ar", "model": synth, "engine": {"disable_overlap_schedule": True},
             "batches": batches, "count_forwards": True},
            {"name": "synth_spec", "model": synth,
             "engine": {**SPEC, "chunked_prefill_size": STEP_BUDGET}, "batches": batches,
             "count_forwards": True, "logits_rows": LOGITS_ROWS},
            {"name": "nld_ar", "model": nld, "batches": {"greedy": _nld_requests()}},
            {"name": "nld_spec", "model": nld, "engine": NLD_SPEC,
             "batches": {"greedy": _nld_requests()}},
            {"name": "synth_adaptive", "model": synth, "engine": adaptive, "prometheus": True,
             "batches": {"greedy": greedy}},
            {"name": "synth_default", "model": synth, "engine": DEFAULT, "prometheus": True,
             "batches": {"greedy": greedy}},
        ],
        "config_errors": {
            "too_many_drafts": {"model": synth, "server_args": {
                **SPEC, "speculative_num_draft_tokens": SYNTH_WIDTH + 1}},
            "nld_too_many_drafts": {"model": nld, "server_args": {
                **SPEC, "speculative_num_draft_tokens": 33}},
            "wrong_family": {"model": str(ckpts["orthrus"]), "server_args": SPEC},
            "plain_qwen3": {"model": str(ckpts["qwen3"]), "server_args": SPEC},
            "draft_model": {"model": synth, "server_args": {
                **SPEC, "speculative_draft_model_path": nld}},
            "tensor_parallel": {"model": synth, "server_args": {**SPEC, "tp_size": 2}},
            "eagle_topk": {"model": synth, "server_args": {**SPEC, "speculative_eagle_topk": 4}},
            "prompt_lookup": {"model": synth, "server_args": {**SPEC, "json_model_override_args":
                json.dumps({"diffspec": {"prompt_lookup": True}})}},
        },
    }
    cache = tmp / "cache"  # this job's latency-profile cache (DIFFSPEC_CACHE_DIR)
    result = run_generate_job(job, tmp, timeout=1800, env={CACHE_ENV: str(cache)})
    result["profiles"] = [json.loads(f.read_text())
                          for f in sorted((cache / "latency-profiles").glob("*.json"))]
    return result


# ------------------------------------------------------------------------------ lossless


def test_request_options_equal_sglang_ar(engine) -> None:
    """Penalties, min_new_tokens and logit bias on TIDAR's verify rows: output == SGLang's
    AR output with the same options (fp32, greedy), drafts accepted; a logprob request is
    refused alone, the requests sent with it equal AR."""
    ar, spec = (engine["runs"][f"synth_{k}"]["options"] for k in ("ar", "spec"))
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    assert sum(m["spec_num_correct_drafts"] for m in spec["meta"]) > 0
    ar, spec = (engine["runs"][f"synth_{k}"]["refused"] for k in ("ar", "spec"))
    assert ar["errors"] == [None] * 3
    assert spec["errors"][1].startswith("ValueError: Drop return_logprob"), spec["errors"]
    assert [spec["outputs"][i] for i in (0, 2)] == [ar["outputs"][i] for i in (0, 2)]


@pytest.mark.parametrize("family", ["synth", "nld"])
def test_greedy_equals_sglang_ar(engine, family: str) -> None:
    assert_equals_ar(engine["runs"][f"{family}_ar"]["greedy"],
                     engine["runs"][f"{family}_spec"]["greedy"], both_endings=family == "synth")


def test_radix_cache_reuse_of_quadratic_kv_equals_ar(engine) -> None:
    """K/V committed by quadratic steps (the verify tokens; never a branch) is inserted into
    the radix cache only up to the committed length: a request that hits it (prompt *and*
    generated tokens) decodes exactly as under AR."""
    for batch in ("prefix_seed", "prefix_reuse"):
        ar = engine["runs"]["synth_ar"][batch]
        assert engine["runs"]["synth_spec"][batch]["outputs"] == ar["outputs"], batch
    seed = engine["runs"]["synth_spec"]["prefix_seed"]["meta"][0]
    assert seed["spec_num_correct_drafts"] > 50  # the cached K/V came from accepted drafts
    reuse = engine["runs"]["synth_spec"]["prefix_reuse"]["meta"][0]
    # the prompt and the 90 generated tokens were committed by the seed request
    assert reuse["cached_tokens"] >= 90


def test_near_the_context_end_equals_ar(engine) -> None:
    """Up to 7 tokens before the 512-token context: still SGLang's AR output."""
    ar = engine["runs"]["synth_ar"]["near_context_end"]
    spec = engine["runs"]["synth_spec"]["near_context_end"]
    assert len(ar["outputs"][0]) == _near_context_end_requests()[0]["max_new_tokens"]
    assert spec["outputs"] == ar["outputs"]


# ------------------------------------------------------------------------------ acceptance


def _reference(path: Path, width: int, prompt: list[int], max_tokens: int):
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.tidar import tidar_generate

    stop = inspect_checkpoint(path).eos_token_ids
    return tidar_generate(load_quadratic(path), [Request(prompt, max_tokens, stop_token_ids=stop)],
                          width - 1)[0]


@pytest.mark.parametrize("family", ["synth", "nld"])
def test_acceptance_per_step_equals_reference_decoder(engine, ckpts, family: str) -> None:
    """The reference's first step (anchor + branch 0, one accepted token) is fused into
    SGLang's prefill; from then on SGLang's steps are the reference's: the same drafts
    and the same number of accepted drafts per step. SGLang reports a request's steps as a
    histogram of accepted drafts, so they are compared as multisets. The reference runs
    with a larger budget, so its last steps verify full blocks as SGLang's do (SGLang
    cuts at ``max_new_tokens`` after accepting); for a request that stopped at an EOS, the
    last step is left out (the reference counts its drafts only up to the EOS)."""
    width = SYNTH_WIDTH if family == "synth" else NLD_WIDTH
    requests = _greedy_requests() if family == "synth" else _nld_requests()
    spec = engine["runs"][f"{family}_spec"]["greedy"]
    accepted_all = []
    for request, out, meta, finish in zip(requests, spec["outputs"], spec["meta"],
                                          spec["finish_reasons"]):
        ref = _reference(ckpts[family], width, request["input_ids"],
                         request["max_new_tokens"] + width)
        assert ref.token_ids[: len(out)] == out
        assert ref.accept_lengths[0] == 1  # the bootstrap step: the first token only
        ref_steps = [a - 1 for a in ref.accept_lengths[1:]]
        steps = meta["spec_verify_ct"]
        sglang_steps = Counter({k: c for k, c in enumerate(meta["spec_correct_drafts_histogram"])
                                if c})
        assert sum(sglang_steps.values()) == steps
        if finish == "length":
            assert Counter(ref_steps[:steps]) == sglang_steps
        else:
            reference_steps = Counter(ref_steps[: steps - 1])
            assert not reference_steps - sglang_steps, (reference_steps, sglang_steps)
        accepted_all += [k for k, c in sglang_steps.items() for _ in range(c)]
    if family == "synth":  # the trained branches really draft: long accepted runs
        assert sum(accepted_all) / len(accepted_all) > 5


def test_logits_stay_within_the_chunk_on_a_long_batch(engine) -> None:
    """Issue 29, row 8: a quadratic step of 8 requests runs 648 rows; the worker computes
    the logits of its verify rows and of the accepted branch only, a chunk at a time."""
    meter = engine["server_info"]["synth_spec"]["logits_meter"]
    assert meter["most_step_tokens"] >= 8 * (SYNTH_WIDTH * SYNTH_WIDTH), meter
    assert_sglang_logits_chunked(meter, SYNTH_WIDTH)


def test_steps_stay_within_sglangs_activation_budget(engine) -> None:
    """Issue 29, item 5: SGLang sizes the memory it leaves for activations per token of its
    largest planned forward (here ``max(--chunked-prefill-size, 2048)`` = 2048); the
    sampled batch runs 48 requests a step, whose full steps (48 x 81 tokens) would exceed
    it: the worker pre-drafts fewer there, so no decode forward runs more tokens (the
    lossless and sampling tests run on this server)."""
    meter = engine["server_info"]["synth_spec"]["logits_meter"]
    assert meter["most_step_requests"] * SYNTH_WIDTH * SYNTH_WIDTH > STEP_BUDGET, meter
    assert meter["most_step_tokens"] <= STEP_BUDGET, meter


def test_one_forward_per_step(engine, ckpts) -> None:
    """A request served alone: SGLang runs one prefill forward (the prompt fused with
    branch 0) and then exactly one ``TARGET_VERIFY`` forward per step, and no other pass
    through the network (counted inside its scheduler process); that is the reference
    decoder's ``num_forwards`` (bootstrap step included), and each forward yields several
    tokens (plain AR: one)."""
    requests = _greedy_requests()
    for name, request in zip(SINGLES, (requests[3], requests[5])):
        spec = engine["runs"]["synth_spec"][name]
        ar = engine["runs"]["synth_ar"][name]
        out = spec["outputs"][0]
        assert out == ar["outputs"][0]
        # the counter counts: AR is one forward (one pass through the network) per token
        assert ar["forwards"] == {"EXTEND": 1, "DECODE": len(out) - 1, "EMBED": len(out)}
        steps = spec["meta"][0]["spec_verify_ct"]
        # no pass through the network outside these forwards (EMBED: every pass)
        assert spec["forwards"] == {"EXTEND": 1, "TARGET_VERIFY": steps, "EMBED": 1 + steps}
        ref = _reference(ckpts["synth"], SYNTH_WIDTH, request["input_ids"],
                         request["max_new_tokens"])
        assert ref.token_ids == out
        assert ref.num_forwards == 1 + steps
        assert len(out) / (1 + steps) > 4  # tokens per forward


def test_avg_spec_accept_length_in_server_info(engine) -> None:
    """``avg_spec_accept_length`` (what ``sglang.bench_serving`` reports) is the tokens per
    verify step of every request the engine served, as the requests' own counters add up
    (those are the reference decoder's). The trained synth-tidar accepts long runs."""
    for run in ("synth_spec", "nld_spec"):
        metas = [m for batch in engine["runs"][run].values() for m in batch["meta"]
                 if m is not None]  # None: a refused request
        assert engine["server_info"][run]["avg_spec_accept_length"] == pytest.approx(
            sglang_tokens_per_verify_step(metas)), run
    # the greedy batch (the sampled one, at T = 0.3, accepts less and dominates the total)
    assert sglang_tokens_per_verify_step(engine["runs"]["synth_spec"]["greedy"]["meta"]) > 4
    assert engine["server_info"]["synth_ar"]["avg_spec_accept_length"] is None


# ------------------------------------------------------------------------------ sampling


def test_sampling_matches_the_ar_distribution(engine, ckpts) -> None:
    """Sampled requests (temperature 0.3, top-p 0.9): SGLang's AR sampler and the quadratic worker's
    rejection sampling both pass a chi-square goodness-of-fit test against the exact
    sequence probabilities; the worker's drafts were both accepted and rejected."""
    from diffspec.model_executors.reference.tidar import load_quadratic

    runs = {name: engine["runs"][f"synth_{name}"]["sampled"] for name in ("ar", "spec")}
    samples = {name: [tuple(o) for o in run["outputs"]] for name, run in runs.items()}
    assert all(len(s) == SAMPLED_TOKENS for seqs in samples.values() for s in seqs)
    accepted = sum(m["spec_num_correct_drafts"] for m in runs["spec"]["meta"])
    steps = sum(m["spec_verify_ct"] for m in runs["spec"]["meta"])
    assert 0 < accepted < steps * (SYNTH_WIDTH - 1)  # drafts accepted and rejected
    assert len(set(samples["spec"])) > 3  # really sampled

    assert_samples_follow_the_model(load_quadratic(ckpts["synth"]).lm, _sampling_prompt(),
                                    samples, TEMPERATURE, NUM_SAMPLES, top_p=TOP_P,
                                    min_cells=10)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("too_many_drafts",
         r"num-draft-tokens 10 is the anchor plus 9 drafts.*block_size=8 \(shifted.*at most 8 "),
        ("nld_too_many_drafts",
         r"anchor plus 32 drafts.*block_size=32 \(unshifted.*at most 31 tokens"),
        ("wrong_family", r"method 'tidar' needs a checkpoint of family tidar or nld.*'orthrus'"),
        ("plain_qwen3", r"method 'tidar' needs a checkpoint of family tidar or nld.*'qwen3'"),
        ("draft_model", r"drafts with the served model itself"),
        ("tensor_parallel", r"TIDAR supports --tp-size 1 only"),
        ("eagle_topk", r"--speculative-eagle-topk must be 1"),
        ("prompt_lookup", r"remove \"prompt_lookup\" \(or set it false\) for method 'tidar': "
                          r"its drafts come free"),
    ],
)
def test_clear_errors(engine, case: str, match: str) -> None:
    assert_clear_error(engine["config_errors"], case, match)


# ------------------------------------------------------------------------------ adaptive


def test_adaptive_drafts_follow_the_batch(engine) -> None:
    """``--json-model-override-args '{"diffspec": {"adaptive": true, "latency_profile":
    P}}'`` on the knee profile: one draft count per step, none while four or more requests
    run (plain AR steps), then 1, up to 2 for the last one alone; output and finish
    reasons are AR's; the choices are counted in Prometheus counters."""
    ar = engine["runs"]["synth_ar"]["greedy"]
    run = engine["runs"]["synth_adaptive"]["greedy"]
    assert run["outputs"] == ar["outputs"]
    assert run["finish_reasons"] == ar["finish_reasons"]
    metrics = engine["server_info"]["synth_adaptive"]["diffspec_metrics"]
    prefix = "diffspec:adaptive_steps_total"
    steps = {int(re.search(r'drafts="(\d+)"', k).group(1)): v for k, v in metrics.items()
             if k.startswith(prefix) and v > 0}
    assert steps.get(0, 0) > 0 and steps.get(2, 0) > 0, steps  # AR steps and 2 drafts
    assert set(steps) <= {0, 1, 2}, steps  # never past the knee
    assert metrics["diffspec:adaptive_draft_tokens_total"] > 0
    assert sum(m["spec_num_correct_drafts"] for m in run["meta"]) > 0


def test_the_default_is_adaptive_with_a_profile_measured_at_start_up(engine) -> None:
    """No diffspec options: adaptive drafting (its choices counted) on a profile the
    worker timed at start-up over TiDAR's step widths and cached; output == AR."""
    ar = engine["runs"]["synth_ar"]["greedy"]
    run = engine["runs"]["synth_default"]["greedy"]
    assert run["outputs"] == ar["outputs"] and run["finish_reasons"] == ar["finish_reasons"]
    metrics = engine["server_info"]["synth_default"]["diffspec_metrics"]
    assert any(k.startswith("diffspec:adaptive_steps_total") for k in metrics), metrics
    (profile,) = engine["profiles"]
    assert profile["key"]["method"] == "tidar" and profile["key"]["engine"] == "sglang"
    assert profile["key"]["max_drafts"] == SYNTH_WIDTH - 1
    assert len(profile["points"]) >= 2 and all(s > 0 for s in profile["points"].values())
