"""Engine tier: Orthrus and NLD linear self-speculation served by a real SGLang 0.5.23 on
its CPU path (fp32, tiny checkpoints in the published layouts, torch-native attention).

SGLang runs in a subprocess under its own interpreter (:mod:`tests.engine.sglang_cpu`):
one ``sglang_generate.py`` run starts the engines one after the other (Orthrus AR, Orthrus
``--speculative-algorithm ORTHRUS``, the trained tiny Orthrus, the Llama-base Orthrus AR and
``ORTHRUS``, NLD AR, NLD ``LINEAR_SELF_SPEC``) and builds server arguments that must fail; a second test starts
``python -m sglang.launch_server`` and reads ``/server_info``. The checks:

* greedy, one batch of mixed-length prompts, ``max_new_tokens`` ending mid-block, an EOS
  inside a block: the self-speculative output equals SGLang's own AR output token for
  token (continuous batching: the requests join and leave the running batch at different
  steps, with different acceptance);
* radix cache: a request whose prompt extends an earlier request by 90 of its generated
  tokens hits the cache (``cached_tokens``) over KV that speculative steps wrote (with
  rejected drafts past the committed length) and still decodes exactly as under AR;
* each request's acceptance per step equals the reference decoder's
  (:mod:`diffspec.spec_workers.reference.decoder` with the reference drafters) on the same checkpoint,
  as SGLang reports it (``spec_verify_ct``, ``spec_correct_drafts_histogram``); on the
  trained tiny Orthrus the drafts are accepted in long runs;
* the Llama-base Orthrus (``OrthrusLlamaForCausalLM``, tied embeddings, no q/k norms) is
  served by ``ORTHRUS`` too: lossless against SGLang's Llama AR, the reference's acceptance;
* per-request options: penalties, ``min_new_tokens``, logit bias, stop strings, min-p ==
  SGLang's (non-overlap) AR output with the same options; logprobs / grammar requests are
  refused alone (the others of the batch equal AR);
* clear errors at server-argument time (fp8 KV cache included); ``avg_spec_accept_length``
  in the server info;
* prompt lookup at a fixed width (the runs above say ``"adaptive": false``, the drafter
  alone at 31 drafts a step): on mixed-length prompts that repeat themselves, AR's output
  token for token, each step's acceptance the reference decoder's with its
  :class:`~diffspec.spec_workers.reference.decoder.LookupDrafter`, lookup drafts counted
  (Prometheus) as the reference counts its lookup steps;
* the default (no diffspec options: adaptive drafting with prompt lookup) equals AR, on a
  latency profile the worker measured at start-up and cached; a second start reuses the
  cached file (rewritten to a compute-bound profile in between); an explicit
  ``latency_profile`` where drafting is free drafts the block, one where every token costs
  the same drafts nothing.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import ASSETS_DIR
from diffspec.profiling import CACHE_ENV
from tests.engine.common import (
    assert_clear_error,
    assert_equals_ar,
    assert_samples_follow_the_model,
    assert_sglang_logits_chunked,
    prefix_requests,
    repeat_requests,
    set_eos_inside_a_block,
    sglang_tokens_per_verify_step,
)
from tests.engine.conftest import require_sglang
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

WIDTH = 32  # --speculative-num-draft-tokens: the anchor + 31 drafts, the checkpoints' block
SYNTH_ORTHRUS = ASSETS_DIR / "synth-orthrus"
# the default: adaptive drafting (priced by the latency profile the worker measures at
# start-up) with prompt lookup
DEFAULT = {"speculative_algorithm": "ORTHRUS", "speculative_num_draft_tokens": WIDTH,
           "decode_log_interval": 1}
# a fixed width (31 drafts every step), the diffusion view alone: as the reference decoder's
# acceptance is compared at
SPEC = {**DEFAULT, "json_model_override_args": json.dumps({"diffspec": {"adaptive": False}})}
# the fixed width with prompt lookup (the reference decoder's LookupDrafter, step for step)
HYBRID = {**DEFAULT, "json_model_override_args": json.dumps(
    {"diffspec": {"adaptive": False, "prompt_lookup": True}})}
NLD_SPEC = {**SPEC, "speculative_algorithm": "LINEAR_SELF_SPEC"}
SYNC = {"disable_overlap_schedule": True}
# Sampling with a low temperature and top-p (a few tokens kept per position by the tiny
# random model), so a chi-square test over whole sequences has enough mass per cell.
TEMPERATURE, TOP_P, NUM_SAMPLES, SAMPLED_TOKENS = 0.03, 0.95, 300, 4
COMPUTE_BOUND = {"1": 0.001, "1000": 1.0}  # every query token costs the same: never draft


# ------------------------------------------------------------------------------ inputs


def _greedy_requests() -> list[dict]:
    rng = np.random.default_rng(7)
    lengths = (3, 9, 17, 70, 40, 130)
    prompts = [rng.integers(20, 250, n).tolist() for n in lengths]
    max_tokens = (20, 45, 7, 50, 33, 40)  # none a multiple of the 32-token block
    return [{"input_ids": p, "max_new_tokens": m} for p, m in zip(prompts, max_tokens)]


def _sampled_requests() -> list[dict]:
    return [{"input_ids": [31], "max_new_tokens": SAMPLED_TOKENS, "temperature": TEMPERATURE,
             "top_p": TOP_P, "ignore_eos": True} for _ in range(NUM_SAMPLES)]


def _synth_requests() -> list[dict]:
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(4, seed=1234)]
    return [{"input_ids": p, "max_new_tokens": m} for p, m in zip(prompts, (64, 45, 90, 57))]


def _near_context_end_requests() -> list[dict]:
    """A request that ends 3 tokens before synth-orthrus's 512-token context: its last
    steps' 32-token blocks reach up to 28 positions past the context."""
    prompt = _synth_requests()[3]["input_ids"]
    return [{"input_ids": prompt, "max_new_tokens": 509 - len(prompt), "ignore_eos": True}]


def _option_requests(path: Path) -> list[dict]:
    """Greedy requests of :func:`_greedy_requests` (same prompts and budgets), each with one
    per-request option the worker applies: repetition / frequency / presence penalty,
    ``min_new_tokens`` past the EOS the plain request stops at, a logit bias against a
    token its plain output has, a stop string its plain output contains, and min-p 1 at
    temperature 1 (only the top token survives: the greedy output)."""
    from transformers import AutoTokenizer

    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    base = _greedy_requests()
    lm = load_orthrus(path).lm
    out0 = ar_generate(lm, [Request(base[0]["input_ids"], 20)])[0].token_ids
    out5 = ar_generate(lm, [Request(base[5]["input_ids"], 40)])[0].token_ids
    k = next(k for k in range(4, len(out0)) if out0[k] not in out0[:k])
    word = AutoTokenizer.from_pretrained(path).decode([out0[k]]).strip()
    return [
        {**base[3], "repetition_penalty": 1.5},
        {**base[4], "frequency_penalty": 1.0},
        {**base[0], "presence_penalty": 1.0},
        {**base[1], "min_new_tokens": 30},
        {**base[5], "logit_bias": {str(out5[5]): -100.0, str(out5[9]): 2.0}},
        {**base[0], "stop": [word]},
        {**base[2], "temperature": 1.0, "min_p": 1.0},
    ]


def _refused_requests() -> list[dict]:
    """Two plain greedy requests sent with two the workers refuse (logprobs, a regex)."""
    base = _greedy_requests()
    return [base[0], {**base[1], "return_logprob": True}, {**base[2], "regex": "[a-z ]+"},
            base[3]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import (
        write_llama_orthrus,
        write_nld,
        write_orthrus,
        write_qwen3,
    )

    root = tmp_path_factory.mktemp("sglang_ckpts")
    paths = {"orthrus": write_orthrus(root / "orthrus"), "nld": write_nld(root / "nld"),
             "qwen3": write_qwen3(root / "qwen3"),
             "llama_orthrus": write_llama_orthrus(root / "llama_orthrus", block_size=WIDTH)}
    from diffspec.model_executors.reference.orthrus import load_orthrus

    # a greedy request stops on an EOS inside a draft block
    set_eos_inside_a_block(paths["orthrus"], load_orthrus(paths["orthrus"]).lm,
                           _greedy_requests()[1]["input_ids"], 45)
    return paths


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every offline engine run of this module, in one subprocess."""
    require_sglang()
    from diffspec.model_executors.reference.orthrus import load_orthrus

    # the reuse request's cached prefix is mostly K/V of generated tokens, written by
    # speculative verify passes
    prefix_seed, prefix_reuse = prefix_requests("sglang", load_orthrus(ckpts["orthrus"]).lm,
                                                list(range(100, 110)))
    batches = {"greedy": _greedy_requests(), "prefix_seed": prefix_seed,
               "prefix_reuse": prefix_reuse, "sampled": _sampled_requests(),
               "options": _option_requests(ckpts["orthrus"]), "refused": _refused_requests()}
    orthrus, nld, llama = str(ckpts["orthrus"]), str(ckpts["nld"]), str(ckpts["llama_orthrus"])
    # a repeating prompt served alone: its lookup steps need no draft forward
    lookup_batches = {"repeats": repeat_requests("sglang"),
                      "alone": [{**repeat_requests("sglang")[0], "ignore_eos": True}]}
    tmp = tmp_path_factory.mktemp("sglang_self_spec")
    free = tmp / "profile_free.json"  # extra query tokens cost nothing: draft the block
    free.write_text(json.dumps({"points": {"1": 0.01, "4096": 0.01}}))
    adaptive_free = {**SPEC, "json_model_override_args": json.dumps({"diffspec": {
        "adaptive": True, "latency_profile": str(free), "prompt_lookup": False}})}
    compute = tmp / "profile_compute.json"  # every query token costs the same: never draft
    compute.write_text(json.dumps({"points": COMPUTE_BOUND}))
    adaptive_compute = {**SPEC, "json_model_override_args": json.dumps({"diffspec": {
        "adaptive": True, "latency_profile": str(compute)}})}
    # a verify of more than 4 tokens per request costs 5x, a draft pass of any width 1 ms:
    # over-drafting pays, carried drafts come often (issue 47 item 4)
    narrow = tmp / "profile_narrow.json"
    narrow.write_text(json.dumps({"points": {"1": 0.010, "4": 0.0101, "5": 0.05,
                                             "4096": 40.0},
                                  "draft_points": {"1": 0.001, "4096": 0.001}}))

    def carry(setting: str) -> dict:
        return {**SPEC, "json_model_override_args": json.dumps({"diffspec": {
            "adaptive": True, "latency_profile": str(narrow), "prompt_lookup": False,
            "carry": setting}})}
    job = {
        "runs": [
            # AR without overlap scheduling, as the speculative runs: SGLang's overlap
            # scheduler feeds the penalizers each token one step late
            {"name": "orthrus_ar", "model": orthrus, "engine": SYNC,
             "batches": {**batches, **lookup_batches}},
            {"name": "orthrus_spec", "model": orthrus, "engine": SPEC, "batches": batches},
            {"name": "orthrus_hybrid", "model": orthrus, "engine": HYBRID, "prometheus": True,
             "batches": lookup_batches},
            {"name": "synth_ar", "model": str(SYNTH_ORTHRUS),
             "batches": {"near_context_end": _near_context_end_requests(),
                         "greedy": _synth_requests(), "one": _synth_requests()[:1]}},
            *({"name": f"synth_carry_{c}", "model": str(SYNTH_ORTHRUS), "prometheus": True,
               "engine": carry(c), "batches": {"one": _synth_requests()[:1],
                                               "greedy": _synth_requests()}}
              for c in ("always", "off")),
            {"name": "synth_spec", "model": str(SYNTH_ORTHRUS), "engine": SPEC,
             "batches": {"greedy": _synth_requests()}, "logits_rows": WIDTH},
            {"name": "synth_near_end_spec", "model": str(SYNTH_ORTHRUS), "engine": SPEC,
             "batches": {"near_context_end": _near_context_end_requests()}},
            # the default twice: the first measures the profile at start-up and caches it
            # (in this job's cache folder); the second reuses it, rewritten first to one
            # where every query token costs the same (what it reads back shows where its
            # profile came from; its steps are then priced through the fit of their measured
            # times, so what it drafts is the machine's word, not the profile's)
            {"name": "synth_default", "model": str(SYNTH_ORTHRUS), "prometheus": True,
             "engine": DEFAULT, "batches": {"greedy": _synth_requests()}},
            {"name": "synth_default_compute", "model": str(SYNTH_ORTHRUS), "prometheus": True,
             "rewrite_cached_profiles": COMPUTE_BOUND, "engine": DEFAULT,
             "batches": {"greedy": _synth_requests()}},
            {"name": "synth_adaptive_free", "model": str(SYNTH_ORTHRUS), "prometheus": True,
             "engine": adaptive_free, "batches": {"greedy": _synth_requests()}},
            # a profile given is taken as is (no fit): where every token costs, no drafts
            {"name": "synth_adaptive_compute", "model": str(SYNTH_ORTHRUS), "prometheus": True,
             "engine": adaptive_compute, "batches": {"greedy": _synth_requests()}},
            {"name": "llama_orthrus_ar", "model": llama,
             "batches": {"greedy": _greedy_requests()}},
            {"name": "llama_orthrus_spec", "model": llama, "engine": SPEC,
             "batches": {"greedy": _greedy_requests()}},
            {"name": "nld_ar", "model": nld, "batches": {"greedy": _greedy_requests()[:4]}},
            {"name": "nld_spec", "model": nld, "engine": NLD_SPEC,
             "batches": {"greedy": _greedy_requests()[:4]}},
        ],
        "config_errors": {
            "too_many_drafts": {"model": orthrus, "server_args": {
                **SPEC, "speculative_num_draft_tokens": 33}},
            "no_diffusion_weights": {"model": str(ckpts["qwen3"]), "server_args": SPEC},
            "wrong_family": {"model": nld, "server_args": SPEC},
            "draft_model": {"model": orthrus, "server_args": {
                **SPEC, "speculative_draft_model_path": nld}},
            "unknown_algorithm": {"model": orthrus, "server_args": {
                **SPEC, "speculative_algorithm": "ORTHROS"}},
            "pipeline_parallel": {"model": orthrus, "server_args": {**SPEC, "pp_size": 2}},
            "fp8_kv_cache": {"model": orthrus, "server_args": {
                **SPEC, "kv_cache_dtype": "fp8_e4m3"}},
        },
    }
    cache = tmp / "cache"  # this job's latency-profile cache (DIFFSPEC_CACHE_DIR)
    result = run_generate_job(job, tmp, timeout=1800, env={CACHE_ENV: str(cache)})
    result["profiles"] = [json.loads(f.read_text())
                          for f in sorted((cache / "latency-profiles").glob("*.json"))]
    return result


# ------------------------------------------------------------------------------ lossless


@pytest.mark.parametrize("family", ["orthrus", "nld"])
def test_greedy_equals_sglang_ar(engine, family: str) -> None:
    assert_equals_ar(engine["runs"][f"{family}_ar"]["greedy"],
                     engine["runs"][f"{family}_spec"]["greedy"], both_endings=family == "orthrus")


def test_near_the_context_end_equals_ar(engine) -> None:
    """Up to 3 tokens before the 512-token context, where the last steps' blocks reach
    past the model's positions: still SGLang's AR output, and blocks were still drafted
    and accepted there."""
    ar = engine["runs"]["synth_ar"]["near_context_end"]
    spec = engine["runs"]["synth_near_end_spec"]["near_context_end"]
    assert len(ar["outputs"][0]) == _near_context_end_requests()[0]["max_new_tokens"]
    assert spec["outputs"] == ar["outputs"]
    meta = spec["meta"][0]
    assert meta["spec_verify_ct"] < len(ar["outputs"][0]) / 2  # long runs accepted


def test_radix_cache_reuse_of_speculated_kv_equals_ar(engine) -> None:
    """KV written by speculative steps is inserted into the radix cache only up to the
    committed length: a request that hits it (prompt *and* generated tokens) decodes
    exactly as under AR."""
    for batch in ("prefix_seed", "prefix_reuse"):
        ar = engine["runs"]["orthrus_ar"][batch]
        assert engine["runs"]["orthrus_spec"][batch]["outputs"] == ar["outputs"]
    reuse = engine["runs"]["orthrus_spec"]["prefix_reuse"]["meta"][0]
    # prompt 10 + 90 generated tokens; the seed request committed the KV of all of them
    assert reuse["cached_tokens"] >= 90


# ------------------------------------------------------------------------------ acceptance


@pytest.mark.parametrize("family", ["orthrus", "nld", "synth"])
def test_acceptance_per_step_equals_reference_decoder(engine, ckpts, family: str) -> None:
    """SGLang's first token comes from the prefill; from then on its steps are the
    reference decoder's on ``prompt + [first token]`` with up to 31 drafts each (fewer
    near the request's ``max_new_tokens``, per request, in both): the same drafts and the
    same number of accepted drafts per step. SGLang reports a request's
    steps as a histogram of accepted drafts, so the steps are compared as multisets (for a
    request that stopped at an EOS, all but the last step: the reference counts that
    step's drafts only up to the EOS)."""
    if family == "nld":
        from diffspec.model_executors.reference.nld import load_nld as load
        from diffspec.spec_workers.reference.linear_self_spec import (
            LinearSelfSpecDrafter as Drafter,
        )
    else:
        from diffspec.model_executors.reference.orthrus import load_orthrus as load
        from diffspec.spec_workers.reference.decoder import BlockDrafter as Drafter
    path = SYNTH_ORTHRUS if family == "synth" else ckpts[family]
    requests = _synth_requests() if family == "synth" else _greedy_requests()
    accepted_all = _accepted_drafts_per_step(
        load(path), Drafter, path, requests, engine["runs"][f"{family}_spec"]["greedy"])
    if family == "synth":  # the trained drafter is really used: long accepted runs
        assert sum(accepted_all) / len(accepted_all) > 5


def _accepted_drafts_per_step(model, drafter_class, path: Path, requests: list[dict],
                              spec: dict, references: list | None = None,
                              width: int = WIDTH) -> list[int]:
    """Check each request's SGLang steps (``width`` tokens: the anchor and its drafts)
    against the reference decoder (see
    :func:`test_acceptance_per_step_equals_reference_decoder`); return the accepted drafts
    of every SGLang step (and append the reference outputs to ``references``)."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, speculative_generate

    stop = inspect_checkpoint(path).eos_token_ids
    accepted_all = []
    for request, out, meta, finish in zip(requests, spec["outputs"], spec["meta"],
                                          spec["finish_reasons"]):
        # the same budget: SGLang drafts per request as the reference does, never past
        # the request's max_new_tokens (the first token came from the prefill)
        ref = speculative_generate(
            model.lm, drafter_class(model),
            [Request(request["input_ids"] + out[:1], request["max_new_tokens"] - 1,
                     stop_token_ids=stop)], width - 1)[0]
        assert ref.token_ids[: len(out) - 1] == out[1:]
        if references is not None:
            references.append(ref)
        steps = meta["spec_verify_ct"]
        hist = meta["spec_correct_drafts_histogram"]
        sglang_steps = Counter({k: c for k, c in enumerate(hist) if c})
        assert sum(sglang_steps.values()) == steps
        if finish == "length":  # no EOS cut: the last step's accepted drafts count too
            assert Counter(a - 1 for a in ref.accept_lengths[:steps]) == sglang_steps
        else:
            reference_steps = Counter(a - 1 for a in ref.accept_lengths[: steps - 1])
            assert not reference_steps - sglang_steps, (reference_steps, sglang_steps)
        accepted_all += [k for k, c in sglang_steps.items() for _ in range(c)]
    return accepted_all


def test_llama_orthrus_greedy_equals_sglang_ar(engine, ckpts) -> None:
    """The Llama-base Orthrus (``OrthrusLlamaForCausalLM``: tied embeddings, no q/k
    norms) under ``--speculative-algorithm ORTHRUS``: greedy fp32 output equals SGLang's
    own Llama AR output on the same checkpoint (mixed-length prompts, ``max_new_tokens``
    mid-block), drafts are accepted, and each step's acceptance is the reference
    decoder's."""
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import BlockDrafter

    ar = engine["runs"]["llama_orthrus_ar"]["greedy"]
    spec = engine["runs"]["llama_orthrus_spec"]["greedy"]
    assert_equals_ar(ar, spec)
    assert "length" in ar["finish_reasons"]  # budgets end mid-block (none a multiple of 32)
    path = ckpts["llama_orthrus"]
    accepted = _accepted_drafts_per_step(load_orthrus(path), BlockDrafter, path,
                                         _greedy_requests(), spec)
    assert sum(accepted) > 0  # the diffusion view's drafts are really accepted


def test_logits_stay_within_the_chunk_on_a_long_batch(engine) -> None:
    """Issue 29, row 8: synth_spec computes its draft and verify logits 32 rows (one
    request's block) at a time; its steps run 4 requests x 32 rows (and their outputs are
    the AR outputs, ``test_acceptance_per_step_equals_reference_decoder``)."""
    meter = engine["server_info"]["synth_spec"]["logits_meter"]
    assert meter["most_step_tokens"] >= 4 * WIDTH, meter
    assert_sglang_logits_chunked(meter, WIDTH)


def test_avg_spec_accept_length_in_server_info(engine) -> None:
    """``avg_spec_accept_length`` (what ``sglang.bench_serving`` reports) is the tokens
    per verify step of every request the engine served, as the requests' own counters add
    up (those are the reference decoder's: see
    :func:`test_acceptance_per_step_equals_reference_decoder`). The random NLD accepts no
    draft at all (exactly 1); the trained synth-orthrus accepts long runs (~16; an untrained
    drafter ~1)."""
    for run in ("orthrus_spec", "synth_spec", "nld_spec", "llama_orthrus_spec"):
        metas = [m for batch in engine["runs"][run].values() for m in batch["meta"]
                 if m is not None]  # None: a refused request
        assert engine["server_info"][run]["avg_spec_accept_length"] == pytest.approx(
            sglang_tokens_per_verify_step(metas)), run
    assert engine["server_info"]["synth_spec"]["avg_spec_accept_length"] > 10
    assert engine["server_info"]["orthrus_ar"]["avg_spec_accept_length"] is None


def test_adaptive_drafts_follow_the_latency_profile(engine) -> None:
    """One draft count per step from the policy. Where extra query tokens are free
    (``--json-model-override-args '{"diffspec": {"adaptive": true, "latency_profile": P}}'``,
    prompt lookup off) it drafts (nearly) the full block, as the fixed width does; where
    every token costs the same (a profile given so, prompt lookup on) it drafts nothing, by
    lookup or otherwise (width-1 verify steps: plain AR, no draft accepted); the output is
    AR's either way, and the default's on a cached profile rewritten so."""
    fixed = engine["runs"]["synth_spec"]["greedy"]
    assert engine["runs"]["synth_default_compute"]["greedy"]["outputs"] == fixed["outputs"]
    names = {"free": "synth_adaptive_free", "compute": "synth_adaptive_compute"}
    runs = {name: engine["runs"][run]["greedy"] for name, run in names.items()}
    assert runs["free"]["outputs"] == fixed["outputs"] == runs["compute"]["outputs"]
    compute = runs["compute"]["meta"]
    assert sum(m["spec_num_correct_drafts"] for m in compute) == 0
    assert engine["server_info"][names["compute"]]["avg_spec_accept_length"] == 1.0
    free = engine["server_info"][names["free"]]["avg_spec_accept_length"]
    assert free >= 0.9 * engine["server_info"]["synth_spec"]["avg_spec_accept_length"]
    # the choices, as Prometheus counters (SGLang's /metrics with --enable-metrics)
    metrics = {name: engine["server_info"][run]["diffspec_metrics"]
               for name, run in names.items()}
    steps = {name: {k: v for k, v in m.items() if k.startswith("diffspec:adaptive_steps_total")}
             for name, m in metrics.items()}
    assert steps["compute"] and set(steps["compute"]) == {
        'diffspec:adaptive_steps_total{drafts="0"}'}
    assert metrics["compute"]["diffspec:adaptive_draft_tokens_total"] == 0
    assert metrics["compute"]["diffspec:prompt_lookup_blocks_total"] == 0
    full = f'diffspec:adaptive_steps_total{{drafts="{WIDTH - 1}"}}'
    # mostly the block (narrower only where every request is near its max_new_tokens)
    assert max(steps["free"], key=steps["free"].get) == full
    assert metrics["free"]["diffspec:adaptive_draft_tokens_total"] > 0


def test_carried_drafts_are_lossless_and_taken(engine) -> None:
    """Over-drafting (``"carry": "always"``) on a profile where a step verifies at most 3
    drafts per request of the 31-draft block: fully accepted steps hand the rest of the
    block to the next step, which verifies it without a draft pass. Greedy output equals
    AR token for token, alone and in the mixed batch (max_new_tokens mid-block); carried
    drafts were taken (the Prometheus counters) and steps ran no draft forward; with
    ``"carry": "off"`` none were."""
    ar = engine["runs"]["synth_ar"]
    for c in ("always", "off"):
        for batch in ("one", "greedy"):
            assert_equals_ar(ar[batch], engine["runs"][f"synth_carry_{c}"][batch])
    on, off = (engine["server_info"][f"synth_carry_{c}"]["diffspec_metrics"]
               for c in ("always", "off"))
    assert on["diffspec:carried_blocks_total"] > 0, on
    assert on["diffspec:carried_draft_tokens_total"] >= on["diffspec:carried_blocks_total"]
    assert off["diffspec:carried_blocks_total"] == 0, off
    assert on["diffspec:draft_blocks_total"] < off["diffspec:draft_blocks_total"], (on, off)
    assert on["diffspec:draft_forwards_skipped_total"] > 0, on


def test_prompt_lookup_equals_ar_and_the_reference_decoder(engine, ckpts) -> None:
    """Prompt lookup at a fixed width (``"adaptive": false, "prompt_lookup": true``) on
    mixed-length prompts that repeat
    themselves, in a batch and one alone: SGLang's AR output token for token; each
    request's steps the reference decoder's with the same rule (:class:`LookupDrafter`);
    the worker's Prometheus count of lookup blocks is the reference's count of lookup
    steps; both sources drafted; the request served alone ran its lookup steps with no
    draft forward."""
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import (
        BlockDrafter,
        LookupDrafter,
        Request,
        speculative_generate,
    )

    runs = engine["runs"]["orthrus_hybrid"]
    for batch in ("repeats", "alone"):
        assert_equals_ar(engine["runs"]["orthrus_ar"][batch], runs[batch])
    model = load_orthrus(ckpts["orthrus"])
    references: list = []
    accepted = _accepted_drafts_per_step(
        model, lambda m: LookupDrafter(BlockDrafter(m)), ckpts["orthrus"],
        repeat_requests("sglang"), runs["repeats"], references)
    assert max(accepted) > 0  # drafts are accepted, not only rejected
    (out,), (meta,) = runs["alone"]["outputs"], runs["alone"]["meta"]
    request = repeat_requests("sglang")[0]
    alone = speculative_generate(  # no EOS stop (ignore_eos)
        model.lm, LookupDrafter(BlockDrafter(model)),
        [Request(request["input_ids"] + out[:1], request["max_new_tokens"] - 1)], WIDTH - 1)[0]
    assert alone.token_ids == out[1:]
    steps = meta["spec_verify_ct"]  # (a last step with no draft left is no verify step)
    assert Counter(a - 1 for a in alone.accept_lengths[:steps]) == Counter(
        {k: c for k, c in enumerate(meta["spec_correct_drafts_histogram"]) if c})
    metrics = engine["server_info"]["orthrus_hybrid"]["diffspec_metrics"]
    lookup_steps = sum(r.num_lookup_steps for r in references) + alone.num_lookup_steps
    assert metrics["diffspec:prompt_lookup_blocks_total"] == lookup_steps > 0, metrics
    assert metrics["diffspec:draft_blocks_total"] > 0, metrics
    # alone, every lookup step skips the draft forward
    assert metrics["diffspec:draft_forwards_skipped_total"] >= alone.num_lookup_steps > 0


def test_the_default_is_adaptive_with_a_profile_measured_at_start_up_and_cached(engine) -> None:
    """No diffspec options: adaptive drafting with prompt lookup (the policy's choices and
    the draft sources counted), priced by a profile the worker timed on SGLang's own model
    runner at start-up and cached, keyed as vLLM's; output == SGLang's AR output. The next
    start with the same key reuses the cached file (rewritten in between to a profile where
    drafting never pays, which it reads back: measuring again would have overwritten it)."""
    ar = engine["runs"]["synth_ar"]["greedy"]
    run = engine["runs"]["synth_default"]["greedy"]
    assert run["outputs"] == ar["outputs"] and run["finish_reasons"] == ar["finish_reasons"]
    metrics = engine["server_info"]["synth_default"]["diffspec_metrics"]
    steps = {k: v for k, v in metrics.items() if k.startswith("diffspec:adaptive_steps_total")}
    assert sum(steps.values()) > 0, metrics  # the policy chose every step's drafts
    # draft sources are counted only with prompt lookup on; the trained model's long
    # accepted runs make drafting pay on a measured profile
    assert (metrics["diffspec:draft_blocks_total"]
            + metrics["diffspec:prompt_lookup_blocks_total"]) > 0, metrics
    (profile,) = engine["profiles"]  # one start measured; the other reused it
    key = profile["key"]
    assert key["engine"] == "sglang" and key["engine_version"] == engine["sglang_version"]
    assert key["method"] == "orthrus" and key["max_drafts"] == WIDTH - 1
    assert key["attention_backend"] == "TorchNativeAttnBackend" and key["dtype"] == "torch.float32"
    assert key["checkpoint"]["path"] == str(SYNTH_ORTHRUS.resolve())
    assert {"device", "threads", "tensor_parallel", "grid", "torch"} <= set(key)
    assert 0 < profile["measured_s"] < 40
    assert profile["points"] == COMPUTE_BOUND  # as rewritten before the second start


# ------------------------------------------------------------------------------ sampling


def test_sampling_matches_the_ar_distribution(engine, ckpts) -> None:
    """Sampled requests (temperature, top-p): SGLang's AR sampler and the self-speculative
    worker's rejection sampling both pass a chi-square goodness-of-fit test against the
    exact sequence probabilities."""
    from diffspec.model_executors.reference.orthrus import load_orthrus

    runs = {name: engine["runs"][f"orthrus_{name}"]["sampled"] for name in ("ar", "spec")}
    samples = {name: [tuple(o) for o in run["outputs"]] for name, run in runs.items()}
    hist = [sum(k * c for k, c in enumerate(m["spec_correct_drafts_histogram"]))
            for m in runs["spec"]["meta"]]
    steps = sum(m["spec_verify_ct"] for m in runs["spec"]["meta"])
    assert 0 < sum(hist) < steps * (SAMPLED_TOKENS - 1)  # drafts accepted and rejected

    assert_samples_follow_the_model(load_orthrus(ckpts["orthrus"]).lm,
                                    _sampled_requests()[0]["input_ids"], samples, TEMPERATURE,
                                    NUM_SAMPLES, top_p=TOP_P)


def test_request_options_equal_sglang_ar(engine) -> None:
    """Per-request penalties, min_new_tokens, logit bias, stop strings and min-p: the
    self-speculative output equals SGLang's AR output with the same options (fp32,
    greedy), and the options really change the output (they are applied, not ignored)."""
    ar = engine["runs"]["orthrus_ar"]["options"]
    spec = engine["runs"]["orthrus_spec"]["options"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    plain = engine["runs"]["orthrus_ar"]["greedy"]["outputs"]
    # repetition, frequency, presence, min_new_tokens, logit bias change the output
    for i, base in enumerate((3, 4, 0, 1, 5)):
        assert ar["outputs"][i] != plain[base], i
    assert len(ar["outputs"][3]) > len(plain[1])  # EOS banned until 30 tokens
    assert ar["finish_reasons"][5] == "stop" and len(ar["outputs"][5]) < 20  # stop string
    assert ar["outputs"][6] == plain[2]  # min_p 1 keeps only the top token
    assert all(m["spec_verify_ct"] for m in spec["meta"][:5])


def test_refused_options_abort_only_their_request(engine) -> None:
    """Logprobs and grammars are refused per request, with a message that says what to do;
    the requests sent with them complete, equal to SGLang's AR output."""
    ar = engine["runs"]["orthrus_ar"]["refused"]
    spec = engine["runs"]["orthrus_spec"]["refused"]
    assert ar["errors"][:2] == [None, None] and ar["errors"][3] is None
    assert spec["errors"][0] is None and spec["errors"][3] is None
    for i in (0, 3):
        assert spec["outputs"][i] == ar["outputs"][i]
    assert spec["errors"][1].startswith("ValueError: Drop return_logprob"), spec["errors"][1]
    assert "--speculative-algorithm ORTHRUS does not support it" in spec["errors"][1]
    if ar["errors"][2] is None:  # SGLang compiled the regex for this tokenizer
        assert spec["errors"][2].startswith("ValueError: Drop json_schema"), spec["errors"][2]


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("too_many_drafts",
         r"num-draft-tokens 33 is the anchor plus 32 drafts.*block_size=32.*at most 31 tokens"),
        ("no_diffusion_weights", r"no diffusion weights.*q_proj_diff"),
        ("wrong_family", r"method 'orthrus' needs a checkpoint of family orthrus"),
        ("draft_model", r"drafts with the served model itself"),
        ("unknown_algorithm", r"Unknown speculative algorithm name: ORTHROS"),
        ("pipeline_parallel", r"ORTHRUS supports --pp-size 1 only"),  # TP: test_sglang_tp
        ("fp8_kv_cache", (r"use --kv-cache-dtype auto with --speculative-algorithm ORTHRUS.*"
                          r"without the scales.*fp8_e4m3")),
    ],
)
def test_clear_errors(engine, case: str, match: str) -> None:
    assert_clear_error(engine["config_errors"], case, match)


_REGISTRATION_PROBE = """
import json
from importlib.metadata import entry_points
from sglang.srt.plugins import load_plugins
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
import diffspec.plugin.sglang as plugin
from diffspec.methods import FAMILIES, methods_for_engine
load_plugins()
plugin.register()  # again: idempotent
algo = SpeculativeAlgorithm.from_string("orthrus")
print(json.dumps({
    "entry_points": [e.value for e in entry_points(group="sglang.srt.plugins")],
    "registered": plugin._registered,
    "algorithms": [SpeculativeAlgorithm.from_string(n).name
                   for n in methods_for_engine("sglang", flag="--speculative-algorithm")],
    "architectures": sorted(a for f in FAMILIES.values() for a in f.sglang_models
                            if a in ModelRegistry.models),
    "scheduler_api": [algo.carries_draft_hidden_states(), algo.need_topk(), algo.has_draft_kv(),
                      algo.is_speculative(), algo.is_eagle(), algo.supports_overlap],
}))
"""


def test_plugin_registers_through_the_entry_point() -> None:
    """``load_plugins()`` finds diffspec through the ``sglang.srt.plugins`` entry point;
    registering twice is harmless; the algorithms answer the scheduler's questions."""
    from tests.engine.sglang_cpu import sglang_cpu_env

    python = require_sglang()
    proc = subprocess.run([python, "-c", _REGISTRATION_PROBE], capture_output=True, text=True,
                          timeout=300, check=False, env=sglang_cpu_env(python))
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "diffspec.plugin.sglang:register" in info["entry_points"]
    assert info["registered"]
    assert info["algorithms"] == ["ORTHRUS", "LINEAR_SELF_SPEC", "TIDAR"]
    from diffspec.methods import FAMILIES

    # every SGLang model class of the registry (self-spec and diffusion LMs) is registered
    assert info["architectures"] == sorted(a for f in FAMILIES.values() for a in f.sglang_models)
    assert {"NemotronLabsDiffusionModel", "OrthrusForCausalLM", "OrthrusLM",
            "OrthrusLlamaForCausalLM", "LLaDAModelLM", "DreamModel",
            "Fast_dLLM_QwenForCausalLM"} == set(info["architectures"])
    assert info["scheduler_api"] == [False, False, False, True, False, False]


# ------------------------------------------------------------------------------ server


def test_launch_server_reports_acceptance_length(ckpts, engine, tmp_path: Path) -> None:
    """``python -m sglang.launch_server --speculative-algorithm ORTHRUS
    --speculative-num-draft-tokens 32`` (a fixed width) on a loopback port: greedy completions equal the
    offline AR outputs, and ``/server_info`` carries ``avg_spec_accept_length`` (what
    ``sglang.bench_serving`` reports): tokens per verify step over the requests served,
    from their own ``meta_info`` counters, which
    :func:`test_acceptance_per_step_equals_reference_decoder` pins to the reference."""
    from diffspec.serving import (
        ServerProcess,
        free_port,
        sglang_accept_length,
        sglang_server_command,
    )
    from tests.engine.sglang_cpu import sglang_cpu_env

    python = require_sglang()
    port = free_port()
    cmd = sglang_server_command(
        ckpts["orthrus"], port, "--speculative-algorithm", "ORTHRUS",
        "--speculative-num-draft-tokens", str(WIDTH), "--device", "cpu",
        "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
        "--disable-cuda-graph", "--dtype", "float32", "--mem-fraction-static", "0.3",
        "--max-total-tokens", "8192", "--decode-log-interval", "1",
        # the fixed width, the drafter alone: the offline fixed-width run's steps, below
        "--json-model-override-args", json.dumps({"diffspec": {"adaptive": False}}),
        # no warm-up request: /server_info then averages over our requests only
        "--skip-server-warmup", python=python)
    requests = _greedy_requests()[:3]
    expected = engine["runs"]["orthrus_ar"]["greedy"]["outputs"][:3]
    with ServerProcess(cmd, port, engine="sglang", log_path=tmp_path / "server.log",
                       env=sglang_cpu_env(python)) as server:
        server.wait_ready(300)
        metas = []
        for request, want in zip(requests, expected):
            out = server.json("/generate", {
                "input_ids": request["input_ids"],
                "sampling_params": {"temperature": 0.0,
                                    "max_new_tokens": request["max_new_tokens"]}})
            assert out["output_ids"] == want
            metas.append(out["meta_info"])
        accept_length = sglang_accept_length(server.url)
    assert accept_length == pytest.approx(sglang_tokens_per_verify_step(metas))
    # the same requests offline (another batch composition): the same verify steps
    offline = engine["runs"]["orthrus_spec"]["greedy"]["meta"][:3]
    assert [m["spec_correct_drafts_histogram"] for m in metas] == [
        m["spec_correct_drafts_histogram"] for m in offline]
