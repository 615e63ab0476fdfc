"""Engine tier: Fast-dLLM in SGLang's dLLM mode (``--dllm-algorithm FastDLLM``), served by a
real SGLang 0.5.23 on its CPU path (fp32, torch-native attention).

One ``sglang_generate.py`` subprocess runs every engine of this module one after the other
(the bundled trained tiny LLaDA, Fast-dLLM v2 and NLD, tiny random Dream and NLD
checkpoints in their real layouts; threshold 0.9 and top-1-only; SGLang's default
first-done-first-out scheduling and its synchronous one) and builds server arguments that
must fail. NLD runs its diffusion mode (block attention, no draft LoRA) in the same
SGLang class as its self-speculation. SGLang's
dLLM scheduler decodes one block per request over the KV of the request's earlier blocks,
aligned at position 0: Fast-dLLM's prefix cache on the block-causal layout, which is
Fast-dLLM v2's own and, for LLaDA / Dream / NLD, the reference decoder's
``FastDLLMConfig(attention="block_causal")``. Under ``cache: dual`` (Fast-dLLM v2's block
cache) a step runs only the current sub-block over the KV the block's other slots got from
the last full-block forward (the reference's ``cache="dual"`` on that layout). The checks:

* one batch of mixed-length prompts (continuous batching, ``max_new_tokens`` ending
  mid-block, prompts ending on a block boundary, EOS / turn end inside a block): every
  output equals the reference decoder's token for token;
* forwards: a request served alone takes the reference's ``num_forwards`` (and, under the
  dual cache, as many window-only forwards: the tokens processed are counted), except that
  SGLang prefills the prompt one block per forward (the reference: one forward); one of
  them (64 tokens) ends on a block boundary inside KV the radix cache holds from the
  batch before, so Fast-dLLM v2's first generated token is the seed kept for that prefix;
* radix cache: a request whose prompt is an earlier prompt plus its output hits the cache
  (block-aligned, generated blocks included) and still decodes as the reference;
* clear errors at server-argument time (cache none, another algorithm, another family, an
  NLD block larger than its trained one), and per request for sampling FastDLLM would
  ignore (temperature > 0: that request is refused alone, the rest of its batch decodes).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_NLD_DIR
from tests.engine.common import assert_fix_first
from tests.engine.conftest import require_sglang
from tests.engine.sglang_cpu import run_generate_job

pytestmark = [pytest.mark.engine, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
# run: (checkpoint, threshold, block_size in the YAML (None: the checkpoint's), FDFO,
#       cache, sub_block_size in the YAML (None: the checkpoint's: v2 8, else the block))
RUNS = {
    "llada_t09": ("llada", 0.9, 8, True, "prefix", None),
    "llada_top1": ("llada", 1.0, 8, True, "prefix", None),
    "v2_t09": ("fast_dllm_v2", 0.9, None, True, "prefix", None),  # bd_size 32, sub-blocks of 8
    "v2_top1": ("fast_dllm_v2", 1.0, None, True, "prefix", None),
    "v2_t09_sync": ("fast_dllm_v2", 0.9, None, False, "prefix", None),  # --no-dllm-fdfo
    "dream_t09": ("dream", 0.9, 8, True, "prefix", None),
    "nld_t09": ("nld", 0.9, None, True, "prefix", None),  # bundled synth-nld, block_size 16
    "nld_tiny_t09": ("nld_tiny", 0.9, None, True, "prefix", None),  # random, block_size 8
    "nld_tiny_top1": ("nld_tiny", 1.0, None, True, "prefix", None),
    # the dual cache: each step runs the current sub-block over the block's cached KV
    "llada_dual_t09": ("llada", 0.9, 8, True, "dual", 4),
    "llada_dual_top1": ("llada", 1.0, 8, True, "dual", 4),
    "v2_dual_t09": ("fast_dllm_v2", 0.9, None, True, "dual", None),
    "v2_dual_top1": ("fast_dllm_v2", 1.0, None, True, "dual", None),
    "v2_dual_t09_sync": ("fast_dllm_v2", 0.9, None, False, "dual", None),
    "dream_dual_t09": ("dream", 0.9, 8, True, "dual", 4),
    "nld_dual_t09": ("nld", 0.9, None, True, "dual", 4),
}
SINGLES = ("single_0", "single_1")
# also serve requests alone, and prefixes
SINGLES_RUNS = ("llada_t09", "v2_t09", "nld_t09", "llada_dual_t09", "v2_dual_t09")
DUAL_RUNS = tuple(run for run, spec in RUNS.items() if spec[4] == "dual")
PROMPT_LENGTHS = (3, 20, 40, 70, 8, 64)  # in the first block, across blocks, on boundaries
MAX_TOKENS = (20, 45, 33, 50, 27, 61)


def _block(run: str, path: Path) -> int:
    from diffspec.core.checkpoint import inspect_checkpoint

    return RUNS[run][2] or inspect_checkpoint(path).block_size


@cache
def _prompts(path: Path) -> tuple[tuple[int, ...], ...]:
    """Prompts of the checkpoint's own words (pairs of synthetic documents), or random
    word ids for a checkpoint with a random tokenizer (Dream)."""
    from transformers import AutoTokenizer

    from diffspec.testing.synthetic import sample_prompts

    if path.is_relative_to(SYNTH_DLLM_DIR) or path == SYNTH_NLD_DIR:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        texts = sample_prompts(12, seed=1)
        prompts = [tokenizer(a + " " + b).input_ids for a, b in zip(texts[::2], texts[1::2])]
    else:
        rng = np.random.default_rng(7)
        prompts = [rng.integers(20, 250, 80).tolist() for _ in PROMPT_LENGTHS]
    assert all(len(p) >= n for p, n in zip(prompts, PROMPT_LENGTHS, strict=True))
    return tuple(tuple(p[:n]) for p, n in zip(prompts, PROMPT_LENGTHS))


def _greedy_requests(path: Path) -> list[dict]:
    return [{"input_ids": list(p), "max_new_tokens": m}
            for p, m in zip(_prompts(path), MAX_TOKENS)]


def _prefix_requests(path: Path, seed_output: list[int] | None = None) -> list[dict]:
    prompt = list(_prompts(path)[3])
    if seed_output is None:
        return [{"input_ids": prompt, "max_new_tokens": 40, "ignore_eos": True}]
    return [{"input_ids": prompt + seed_output, "max_new_tokens": 30, "ignore_eos": True}]


def _reference(run: str, path: Path, requests: list[dict]) -> list:
    """The reference decoder with the run's settings; stops: the checkpoint's EOS and its
    chat template's turn end, as the engine's."""
    from transformers import AutoTokenizer

    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.fast_dllm import (
        FastDLLMConfig,
        fast_dllm_generate,
        turn_end_token_ids,
    )

    stops = (*inspect_checkpoint(path).eos_token_ids,
             *turn_end_token_ids(AutoTokenizer.from_pretrained(path, trust_remote_code=False)))
    _, threshold, block, _, cache_mode, sub = RUNS[run]
    config = FastDLLMConfig(cache=cache_mode, threshold=threshold, block_size=block,
                            sub_block_size=sub, attention="block_causal")
    return fast_dllm_generate(_lm(path), [
        Request(r["input_ids"], r["max_new_tokens"],
                stop_token_ids=() if r.get("ignore_eos") else stops) for r in requests], config)


@cache
def _lm(path: Path):
    from diffspec.model_executors.reference.dllm import load_dllm

    return load_dllm(path)


def _yaml(folder: Path, name: str, text: str) -> str:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffspec.testing.checkpoints import write_dream, write_nld, write_qwen3

    root = tmp_path_factory.mktemp("sglang_fast_dllm_ckpts")
    return {"llada": SYNTH_DLLM_DIR / "llada", "fast_dllm_v2": SYNTH_DLLM_DIR / "fast_dllm_v2",
            "dream": write_dream(root / "dream"), "qwen3": write_qwen3(root / "qwen3"),
            "nld": SYNTH_NLD_DIR, "nld_tiny": write_nld(root / "nld", block_size=8)}


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every engine run of this module, in one subprocess."""
    require_sglang()
    tmp = tmp_path_factory.mktemp("sglang_fast_dllm")
    runs = []
    for name, (family, threshold, block, fdfo, cache_mode, sub) in RUNS.items():
        path = ckpts[family]
        greedy = _greedy_requests(path)
        batches = {"greedy": greedy}
        if name in SINGLES_RUNS:
            seed = _reference(name, path, _prefix_requests(path))[0].token_ids
            batches |= {SINGLES[0]: [greedy[1]], SINGLES[1]: [greedy[5]],
                        "prefix_seed": _prefix_requests(path),
                        "prefix_reuse": _prefix_requests(path, seed)}
        if name == "nld_tiny_t09":  # one request asks for sampling: refused alone
            batches["sampling"] = [{**r, "may_fail": True} for r in greedy[:3]]
            batches["sampling"][1]["temperature"] = 0.7
        options = (f"threshold: {threshold}\n" + (f"block_size: {block}\n" if block else "")
                   + (f"cache: {cache_mode}\n" if cache_mode != "prefix" else "")
                   + (f"sub_block_size: {sub}\n" if sub else ""))
        runs.append({"name": name, "model": str(path), "count_forwards": True,
                     "batches": batches,
                     "engine": {"max_running_requests": 8, "dllm_fdfo": fdfo,
                                "dllm_algorithm": "FastDLLM",
                                "dllm_algorithm_config": _yaml(tmp, name, options)}})
    llada, fast = str(ckpts["llada"]), {"dllm_algorithm": "FastDLLM"}
    job = {"runs": runs, "config_errors": {
        "no_cache": {"model": llada, "server_args": {
            **fast, "dllm_algorithm_config": _yaml(tmp, "none", "cache: none\n")}},
        "dual_paged_backend": {"model": llada, "server_args": {
            **fast, "attention_backend": "triton",
            "dllm_algorithm_config": _yaml(tmp, "dual_triton", "cache: dual\n")}},
        "unknown_key": {"model": llada, "server_args": {
            **fast, "dllm_algorithm_config": _yaml(tmp, "unknown", "steps: 4\n")}},
        "v2_block_too_large": {"model": str(ckpts["fast_dllm_v2"]), "server_args": {
            **fast, "dllm_algorithm_config": _yaml(tmp, "large", "block_size: 64\n")}},
        "other_algorithm": {"model": llada, "server_args": {"dllm_algorithm": "LowConfidence"}},
        "causal_checkpoint": {"model": str(ckpts["qwen3"]), "server_args": fast},
        "nld_block_too_large": {"model": str(ckpts["nld"]), "server_args": {
            **fast, "dllm_algorithm_config": _yaml(tmp, "nld_large", "block_size: 32\n")}},
    }}
    return run_generate_job(job, tmp, timeout=2400)


# ------------------------------------------------------------------------------ outputs


@pytest.mark.parametrize("run", list(RUNS))
def test_mixed_length_batch_equals_reference(engine, ckpts, run: str) -> None:
    """Continuous batching of prompts of 3..70 tokens: token for token the reference's."""
    path = ckpts[RUNS[run][0]]
    got = engine["runs"][run]["greedy"]
    ref = _reference(run, path, _greedy_requests(path))
    assert got["outputs"] == [o.token_ids for o in ref]
    assert got["finish_reasons"] == [o.finish_reason for o in ref]
    if run == "llada_t09":  # the batch really has both endings
        assert set(got["finish_reasons"]) == {"stop", "length"}
    if RUNS[run][1] < 1 and RUNS[run][0] in ("llada", "fast_dllm_v2", "nld"):  # trained
        assert any(max(o.accept_lengths) > 1 for o in ref)


@pytest.mark.parametrize("run", SINGLES_RUNS)
def test_forwards_per_token_equal_reference(engine, ckpts, run: str) -> None:
    """A request served alone: SGLang's ``DLLM_EXTEND`` forwards (counted in its scheduler
    process; ``EMBED`` counts every pass through the network) are the reference's
    ``num_forwards``, with the prompt's full blocks prefilled one per forward instead of
    all in one (none when the radix cache holds them: these prompts ran in the batch
    before), and one more forward when the last block ends full (its KV is written for
    the radix cache; the reference has no later reader) or when a shifted family's last
    token is the one seeded into a block's first slot (SGLang runs a block's first
    forward before any step; the reference finishes at the seed)."""
    path = ckpts[RUNS[run][0]]
    block = _block(run, path)
    requests = _greedy_requests(path)
    for name, request in zip(SINGLES, (requests[1], requests[5])):
        got = engine["runs"][run][name]
        ref = _reference(run, path, [request])[0]
        assert got["outputs"][0] == ref.token_ids
        full_blocks = len(request["input_ids"]) // block
        prefills = full_blocks - got["meta"][0]["cached_tokens"] // block
        end = len(request["input_ids"]) + len(ref.token_ids)  # slots up to the last token
        ends_full = end % block == 0
        ends_on_seed = _lm(path).logits_shift and end % block == 1
        expected = ref.num_forwards - (full_blocks > 0) + prefills + ends_full + ends_on_seed
        assert got["forwards"] == {"DLLM_EXTEND": expected, "EMBED": expected}, name
        assert len(ref.token_ids) / ref.num_forwards > 1.5  # parallel decoding pays
        # tokens processed: whole blocks, except the dual cache's window-only steps, which
        # run one sub-block over the block's cached KV (as many as the reference's)
        windows = ref.window_forwards
        sub = RUNS[run][5] or (8 if RUNS[run][0] == "fast_dllm_v2" else block)
        assert (windows > 0) == (run in DUAL_RUNS), name
        assert got["tokens"]["DLLM_EXTEND"] == block * (expected - windows) + sub * windows, name


@pytest.mark.parametrize("run", SINGLES_RUNS)
def test_radix_cache_reuse_equals_reference(engine, ckpts, run: str) -> None:
    """The second request's prompt is the first one's (70 tokens) plus its 40 tokens:
    SGLang reuses the block-aligned KV, generated blocks included (written by completing
    forwards), and still decodes as the reference does from scratch."""
    path = ckpts[RUNS[run][0]]
    seed = engine["runs"][run]["prefix_seed"]["outputs"]
    assert seed == [o.token_ids for o in _reference(run, path, _prefix_requests(path))]
    reuse = _prefix_requests(path, seed[0])
    assert engine["runs"][run]["prefix_reuse"]["outputs"] == [
        o.token_ids for o in _reference(run, path, reuse)]
    cached = engine["runs"][run]["prefix_reuse"]["meta"][0]["cached_tokens"]
    block = _block(run, path)
    # every whole block before the prompt's last token, generated ones included
    assert cached == (len(reuse[0]["input_ids"]) - 1) // block * block > 70


# ------------------------------------------------------------------------------ errors


ERRORS = {
    "no_cache": "set cache: prefix or dual",
    "dual_paged_backend": "set --attention-backend torch_native for cache: dual",
    "unknown_key": "remove steps from",
    "v2_block_too_large": "fix ",
    "other_algorithm": "use --dllm-algorithm FastDLLM",
    "causal_checkpoint": "serve a LLaDAModelLM / DreamModel / Fast_dLLM_QwenForCausalLM / "
                         "NemotronLabsDiffusionModel checkpoint with --dllm-algorithm FastDLLM",
    "nld_block_too_large": "fix ",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_clear_errors(engine, case: str) -> None:
    """What to do comes first in the message."""
    assert_fix_first(engine["config_errors"][case], case, ERRORS[case])


def test_sampling_request_is_refused_alone(engine, ckpts) -> None:
    """Temperature 0.7 (FastDLLM decodes greedily): SGLang aborts that request with the
    message (what to do first); the other requests of the batch decode as the reference."""
    got = engine["runs"]["nld_tiny_t09"]["sampling"]
    assert got["errors"][0] is None and got["errors"][2] is None
    assert got["outputs"][1] is None
    assert "set temperature 0 (or top_k 1) for --dllm-algorithm FastDLLM" in got["errors"][1]
    assert "would ignore temperature 0.7" in got["errors"][1]
    requests = _greedy_requests(ckpts["nld_tiny"])
    ref = _reference("nld_tiny_t09", ckpts["nld_tiny"], [requests[0], requests[2]])
    assert [got["outputs"][0], got["outputs"][2]] == [o.token_ids for o in ref]
