"""Engine tier: ReFusion in SGLang's dLLM mode (``--dllm-algorithm ReFusion``), served by a
real SGLang 0.5.23 on its CPU path (fp32, torch-native attention), against the reference
decoder (:mod:`diffspec.spec_workers.reference.refusion`) with the same settings.

One ``sglang_generate.py`` subprocess runs every engine of this module one after the other:
the bundled trained ``synth-refusion`` (the registry defaults with no YAML: slots of 32,
thresholds 0.9 / 0.4, one serial block; slots of 8 with slot threshold 0, so every
masked slot is planned and completed in parallel rows, in 2 serial blocks) and a tiny
random checkpoint in the published layout
(Qwen3 + ``<|mask|>`` / ``<|beginoftext|>``; slots of 4, and slots of 4 at slot threshold
0, whose parallel completions need more free request-pool rows than there are, so the
requests' completions take turns). The checks:

* a batch of mixed-length prompts (continuous batching, several requests per dLLM batch,
  ``max_new_tokens`` ending mid-slot, a request stop token hit inside a slot): every output
  equals the reference decoder's token for token;
* forwards: the requests of a dLLM batch share SGLang's ``DLLM_EXTEND`` forwards (one
  forward per step holds every in-flight request's rows), so a batch runs fewer of them
  than the reference's ``num_forwards`` summed over its requests, and at least the
  slowest request's (the prompt is SGLang's one ``EXTEND`` prefill, as the reference's
  uncounted prefill); a lone request runs exactly the reference's;
* KV reuse: the tokens those forwards process are exactly the reference's summed over the
  requests (whose cache never recomputes a committed slot), so each request's share of a
  forward holds only the masked / drafted tokens of its round over the committed slots' KV;
* clear errors: bad YAML, a block that is not whole slots, a checkpoint that is not
  ReFusion's, too few request-pool rows, and per request temperature > 0 or
  ``max_new_tokens`` past the block or not splitting into the serial blocks.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import SYNTH_REFUSION_DIR as SYNTH
from tests.engine.common import assert_fix_first
from tests.engine.conftest import require_sglang
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
# run: (checkpoint, YAML settings (None: no YAML, the registry defaults), block_size)
RUNS = {
    "synth_s8_all": ("synth", {"slot_size": 8, "slot_threshold": 0.0, "num_blocks": 2,
                               "block_size": 64}, 64),
    "synth_defaults": ("synth", None, 256),
    "published_s4": ("published", {"slot_size": 4, "slot_threshold": 0.5, "block_size": 32}, 32),
    # every round completes all 8 slots in parallel: 7 scratch rows each, 7 rows free
    # (12 - 5 running), so the requests' completions take turns
    "published_s4_all": ("published", {"slot_size": 4, "slot_threshold": 0.0,
                                       "block_size": 32}, 32),
}
PROMPT_LENGTHS = (3, 20, 45, 70, 9, 33)
MAX_TOKENS = (64, 47, 57, 30, 64, 61)  # all split into 2 serial blocks of slots of 8
STOP_REQUEST, STOP_AT = 5, 21  # that request stops at its reference output's token 21


@cache
def _prompts(path: Path) -> tuple[tuple[int, ...], ...]:
    """Prompts of the checkpoint's own words, or random word ids for a random checkpoint."""
    from transformers import AutoTokenizer

    from diffspec.testing.synthetic import sample_prompts

    if path == SYNTH:
        tokenizer = AutoTokenizer.from_pretrained(path)
        texts = sample_prompts(12, seed=1)
        prompts = [tokenizer(a + " " + b).input_ids for a, b in zip(texts[::2], texts[1::2])]
    else:
        rng = np.random.default_rng(7)
        prompts = [rng.integers(20, 120, 80).tolist() for _ in PROMPT_LENGTHS]
    return tuple(tuple(p[:n]) for p, n in zip(prompts, PROMPT_LENGTHS, strict=True))


def _settings(run: str) -> dict:
    from diffspec.methods import get_method

    return {**get_method("refusion").defaults, **(RUNS[run][1] or {})}


def _requests(run: str, path: Path) -> list[dict]:
    """The batch; one request gets a stop token taken from inside its own free output."""
    block = RUNS[run][2]
    requests = [{"input_ids": list(p), "max_new_tokens": min(m, block)}
                for p, m in zip(_prompts(path), MAX_TOKENS)]
    free = _reference(run, path, [requests[STOP_REQUEST]], ())[0].token_ids
    requests[STOP_REQUEST]["stop_token_ids"] = [free[STOP_AT]]
    return requests


def _prefix_requests(path: Path) -> list[dict]:
    """A prompt that starts with the batch's 70-token prompt (its first 64-token page is in
    SGLang's radix cache by then) and goes on with another prompt's words."""
    prompts = _prompts(path)
    return [{"input_ids": [*prompts[3], *prompts[2][:10]], "max_new_tokens": 32}]


def _reference(run: str, path: Path, requests: list[dict], stops: tuple[int, ...] | None = None
               ) -> list:
    """The reference decoder, one request at a time; ``num_tokens`` on each output: the
    tokens its forwards processed after the prompt prefill."""
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate

    model, info = _lm(path)
    settings = {k: v for k, v in _settings(run).items() if k != "block_size"}
    outputs = []
    for r in requests:
        calls: list[int] = []
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kw, calls=calls: calls.append(kw["input_ids"].numel()),
            with_kwargs=True)
        try:
            request_stops = stops if stops is not None else (
                *info.eos_token_ids, *r.get("stop_token_ids", ()))
            out = refusion_generate(model, [Request(r["input_ids"], r["max_new_tokens"],
                                                    stop_token_ids=request_stops)],
                                    ReFusionConfig(**settings), int(info.mask_token_id))[0]
        finally:
            hook.remove()
        out.num_tokens = sum(calls[1:])  # calls[0]: the prompt prefill
        outputs.append(out)
    return outputs


@cache
def _lm(path: Path):
    from diffspec.model_executors.reference.refusion import load_refusion

    return load_refusion(path)


def _yaml(folder: Path, name: str, settings: dict) -> str:
    path = folder / f"{name}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import write_qwen3, write_refusion

    root = tmp_path_factory.mktemp("sglang_refusion_ckpts")
    return {"synth": SYNTH, "published": write_refusion(root / "published"),
            "qwen3": write_qwen3(root / "qwen3")}


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every engine run of this module, in one subprocess."""
    require_sglang()
    tmp = tmp_path_factory.mktemp("sglang_refusion")
    runs = []
    for name, (family, settings, block) in RUNS.items():
        path = ckpts[family]
        requests = _requests(name, path)
        batches = {"batch": requests}
        if name == "synth_s8_all":
            refused = [dict(requests[0], temperature=0.7, may_fail=True),
                       dict(requests[1], max_new_tokens=block + 1, may_fail=True),
                       dict(requests[2], max_new_tokens=40, may_fail=True),  # 2 x 2.5 slots
                       dict(requests[3], may_fail=True)]
            batches["refused"] = refused
            batches["prefix_reuse"] = _prefix_requests(path)
        # 12 request-pool rows: 7 for the parallel completion of 8 slots, 5 requests at once
        engine_args = {"max_running_requests": 12, "dllm_algorithm": "ReFusion"}
        if settings is not None:
            engine_args["dllm_algorithm_config"] = _yaml(tmp, name, settings)
        runs.append({"name": name, "model": str(path), "count_forwards": True,
                     "batches": batches, "engine": engine_args})
    synth, refusion = str(SYNTH), {"dllm_algorithm": "ReFusion"}

    def bad(name: str, settings: dict) -> dict:
        return {"model": synth, "server_args": {
            **refusion, "dllm_algorithm_config": _yaml(tmp, name, settings)}}

    job = {"runs": runs, "config_errors": {
        "unknown_key": bad("unknown", {"steps": 4}),
        "threshold": bad("threshold", {"token_threshold": 1.5}),
        "serial_blocks": bad("serial", {"num_blocks": 0}),
        "block_not_slots": bad("block", {"slot_size": 32, "block_size": 48}),
        "qwen3_checkpoint": {"model": str(ckpts["qwen3"]), "server_args": refusion},
        "request_pool": {"model": synth, "server_args": {**refusion, "max_running_requests": 4}},
    }}
    return run_generate_job(job, tmp, timeout=1200)


# ------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize("run", list(RUNS))
def test_mixed_length_batch_equals_reference(engine, ckpts, run: str) -> None:
    """Prompts of 3..70 tokens batched together: token for token the reference's."""
    path = ckpts[RUNS[run][0]]
    got = engine["runs"][run]["batch"]
    ref = _reference(run, path, _requests(run, path))
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["finish_reasons"] == [o.finish_reason for o in ref]
    assert got["finish_reasons"][STOP_REQUEST] == "stop"  # the stop inside a slot
    assert len(got["outputs"][STOP_REQUEST]) <= STOP_AT + 1
    if run == "synth_s8_all":  # every slot planned: parallel completion over several rows
        assert any(max(o.slots_per_plan) > 2 for o in ref)


@pytest.mark.parametrize("run", list(RUNS))
def test_batched_forwards_and_tokens_equal_reference(engine, ckpts, run: str) -> None:
    """Several requests' rounds share each ``DLLM_EXTEND`` forward: fewer forwards than the
    reference's summed over the requests, at least the slowest request's; the tokens they
    process are the reference's summed: a committed slot's KV is written once, at its true
    positions, and read by every later forward; no forward runs a committed token again."""
    path = ckpts[RUNS[run][0]]
    got = engine["runs"][run]["batch"]
    ref = _reference(run, path, _requests(run, path))
    forwards = sum(o.num_forwards for o in ref)
    assert max(o.num_forwards for o in ref) <= got["forwards"]["DLLM_EXTEND"] < forwards
    # the prompts: SGLang's causal EXTEND prefill (several prompts per forward)
    assert got["tokens"]["EXTEND"] == sum(len(p) for p in _prompts(path))
    assert got["tokens"]["DLLM_EXTEND"] == sum(o.num_tokens for o in ref)
    if RUNS[run][0] == "synth":  # trained: slots commit several tokens per forward
        assert sum(len(o.token_ids) for o in ref) / forwards > 1.5


def test_radix_prefix_reuse_equals_reference(engine, ckpts) -> None:
    """A prompt whose first page (64 tokens: SGLang's dLLM page is the block) was prefilled
    for an earlier request reuses that page's KV and still decodes as the reference."""
    path = ckpts["synth"]
    got = engine["runs"]["synth_s8_all"]["prefix_reuse"]
    ref = _reference("synth_s8_all", path, _prefix_requests(path))
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["meta"][0]["cached_tokens"] == 64
    assert got["forwards"]["DLLM_EXTEND"] == ref[0].num_forwards
    assert got["tokens"]["EXTEND"] == len(_prefix_requests(path)[0]["input_ids"]) - 64


def test_refused_requests_say_what_to_do(engine) -> None:
    """Temperature > 0, ``max_new_tokens`` past the block or not splitting into the serial
    blocks are refused per request, the others in the same batch still served."""
    got = engine["runs"]["synth_s8_all"]["refused"]
    assert "set temperature 0" in got["errors"][0]
    assert "set max_new_tokens <= 64" in got["errors"][1]
    assert "set max_new_tokens to a multiple of 16" in got["errors"][2]
    assert got["errors"][3] is None and got["outputs"][3]


# ------------------------------------------------------------------------------ errors


ERRORS = {
    "unknown_key": "remove steps from",
    "threshold": "fix ",
    "serial_blocks": "fix ",
    "block_not_slots": "set block_size",
    "qwen3_checkpoint": "serve a ReFusion checkpoint",
    "request_pool": "raise --max-running-requests to at least 8",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_clear_errors(engine, case: str) -> None:
    """What to do comes first in the message."""
    assert_fix_first(engine["config_errors"][case], case, ERRORS[case])
