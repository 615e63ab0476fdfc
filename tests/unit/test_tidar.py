"""TiDAR / NLD quadratic self-speculation (:mod:`diffspec.spec_workers.reference.tidar`).

Lossless vs plain AR decoding in fp32 (greedy, two seeds, rejection sampling), the branch the
decoder selects vs a brute-force recomputation (one forward per branch), the KV kept after
each commit vs a fresh causal prefill, EOS inside the accepted block, max_tokens mid-block,
the context limit, NLD's interleaved layout, one forward per step.

Models: tiny random checkpoints (a Qwen3 in the TiDAR layout, shifted and unshifted; NLD,
unshifted and ``dlm_type: dream``) and the shipped tiny TiDAR model trained on the synthetic
language (``diffspec/assets/synth-tidar``), where drafts are mostly accepted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
import torch
from torch import Tensor

from diffspec.core.checkpoint import CheckpointError
from diffspec.core.masks import quadratic_branch_indices
from diffspec.core.sampling import SamplingParams, probs_from_logits
from diffspec.model_executors.reference.tidar import (
    QuadraticModel,
    commit_kv,
    load_quadratic,
    quadratic_forward,
)
from diffspec.model_executors.reference.views import block_view_logits
from diffspec.spec_workers.reference import tidar
from diffspec.spec_workers.reference.decoder import (
    Request,
    RequestOutput,
    ar_generate,
    sample_drafts,
)
from diffspec.spec_workers.reference.tidar import tidar_generate
from diffspec.testing.checkpoints import write_nld, write_orthrus, write_qwen3
from diffspec.testing.stats import chi_square_test
from diffspec.testing.synthetic import build_tokenizer, sample_prompts
from diffspec.testing.synthetic_tidar import SYNTH_TIDAR_DIR
from tests.unit.kv import prefilled_cache
from tests.unit.lossless_cases import GREEDY, SAMPLINGS

# name: (writer, config overrides); mask id 7 is a reserved slot of the Qwen tokenizer.
LAYOUTS = {
    "qwen3_tidar_shifted": (write_qwen3, {"mask_token_id": 7, "block_size": 4,
                                          "dlm_type": "dream"}),
    "qwen3_tidar_unshifted": (write_qwen3, {"mask_token_id": 7, "block_size": 5}),
    "nld_with_lora": (write_nld, {"block_size": 5}),
    "nld_dream": (write_nld, {"block_size": 4, "dlm_type": "dream", "with_lora": False}),
}


@dataclass
class Case:
    model: QuadraticModel
    prompts: list[list[int]]
    eos: tuple[int, ...] = ()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("tidar")
    rng = random.Random(0)
    cases = {}
    for name, (writer, overrides) in LAYOUTS.items():
        model = load_quadratic(writer(root / name, **overrides))
        prompts = [[rng.randrange(20, 200) for _ in range(n)] for n in (1, 4, 9)]
        cases[name] = Case(model, prompts, model.eos_token_ids)
    return cases


@pytest.fixture(scope="module")
def synth() -> Case:
    model = load_quadratic(SYNTH_TIDAR_DIR)
    tok = build_tokenizer()
    prompts = [tok(p)["input_ids"] for p in sample_prompts(3, 5)]
    prompts.append(prompts[0][:2])  # a short one among long ones
    return Case(model, prompts, model.eos_token_ids)


@dataclass
class Step:
    """What one call of ``quadratic_forward`` saw."""

    prefix_len: int
    anchor: int
    drafts: list[int]
    num_masks: int
    kv: list[tuple[Tensor, Tensor]]  # the cache at step start, per layer


@dataclass
class Recorder:
    steps: list[Step] = field(default_factory=list)

    def __call__(self, model, cache, anchor, drafts, num_masks):
        kv = [(layer.keys.clone(), layer.values.clone())
              for layer in cache.layers] if cache.get_seq_length() else []
        self.steps.append(Step(cache.get_seq_length(), anchor, list(drafts), num_masks, kv))
        return quadratic_forward(model, cache, anchor, drafts, num_masks)


def _assert_lossless(case: Case, requests: list[Request], **kwargs) -> list[RequestOutput]:
    ar = ar_generate(case.model.lm, requests)
    out = tidar_generate(case.model, requests, **kwargs)
    for a, o in zip(ar, out):
        assert o.token_ids == a.token_ids
        assert o.finish_reason == a.finish_reason
        assert sum(o.accept_lengths) == len(o.token_ids)
        assert o.num_forwards == len(o.accept_lengths)  # one forward per step
    return out


def _brute_force_branch(model: QuadraticModel, prefix: list[int], verify: list[int],
                        num_masks: int) -> Tensor:  # [num_masks, vocab]
    """Branch logits recomputed alone: ``verify`` causal after ``prefix``, then ``num_masks``
    masks that see the prefix, all of ``verify`` and each other."""
    cache = prefilled_cache(model.lm, prefix)
    p, v, k = len(prefix), len(verify), num_masks
    mask = torch.zeros(v + k, p + v + k, dtype=torch.bool)
    mask[:, :p] = True
    for i in range(v):
        mask[i, p : p + i + 1] = True
    mask[v:, p:] = True
    ids = torch.tensor(verify + [model.mask_token_id] * k)
    with torch.inference_mode():
        logits = block_view_logits(model.lm, ids, torch.arange(p, p + v + k), cache, mask)
    return logits[v:].float()


# ------------------------------------------------------------------- lossless vs AR


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_layouts_equal_ar(layout, sampling, models):
    case = models[layout]
    requests = [Request(p, 14, SAMPLINGS[sampling], case.eos) for p in case.prompts]
    out = _assert_lossless(case, requests)
    assert sum(o.num_draft_tokens for o in out) > 0


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_trained_tidar_equals_ar_and_accepts(sampling, synth):
    requests = [Request(p, 40, SAMPLINGS[sampling], synth.eos) for p in synth.prompts]
    out = _assert_lossless(synth, requests)
    tokens = sum(len(o.token_ids) for o in out)
    assert tokens / sum(o.num_forwards for o in out) > 2.0  # TPF: drafts are mostly right


@pytest.mark.parametrize("num_draft_tokens", [0, 1, 3])
def test_fewer_drafts_per_step(num_draft_tokens, synth):
    requests = [Request(p, 24, GREEDY, synth.eos) for p in synth.prompts[:2]]
    out = _assert_lossless(synth, requests, num_draft_tokens=num_draft_tokens)
    assert all(o.num_draft_tokens <= num_draft_tokens * len(o.accept_lengths) for o in out)
    assert all(max(o.accept_lengths) <= num_draft_tokens + 1 for o in out)


def test_rejection_sampling_on_a_greedy_request_equals_ar(synth):
    """Rejection sampling with one-hot target probabilities is greedy decoding."""
    requests = [Request(p, 30, GREEDY, synth.eos) for p in synth.prompts]
    out = _assert_lossless(synth, requests, accept="rejection")
    assert sum(o.num_accepted_tokens for o in out) > 0


def test_rejection_sampling_is_seeded_and_accepts(synth):
    params = SamplingParams(temperature=1.0, seed=3)
    requests = [Request(p, 30, params, synth.eos) for p in synth.prompts]
    first = tidar_generate(synth.model, requests, accept="rejection")
    again = tidar_generate(synth.model, requests, accept="rejection")
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert sum(o.num_accepted_tokens for o in first) > 0
    assert all(o.num_forwards == len(o.accept_lengths) for o in first)


@pytest.mark.slow
def test_rejection_sampling_matches_ar_distribution(synth):
    """The first three tokens (top-k 3: at most 27 sequences) drawn by quadratic decoding
    with rejection sampling follow the AR model's exact joint distribution (chi-square).
    The prompt ends at a phrase end and the temperature is high, so the joint is spread
    (its mode ~0.37) and a draft both passes and fails often; drafting the argmax while
    claiming ``q`` fails this test (p ~ 1e-18 at 800 samples)."""
    lm, prompt = synth.model.lm, synth.prompts[1][:-1]
    params = SamplingParams(temperature=4.0, top_k=3)
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):  # enumerate the AR joint, one position at a time
        grown = {}
        for seq, p in exact.items():
            with torch.inference_mode():
                logits = lm(torch.tensor([prompt + list(seq)])).logits[0, -1]
            probs = probs_from_logits(logits, params)
            for t in probs.nonzero().flatten().tolist():
                grown[seq + (t,)] = p * float(probs[t])
        exact = grown
    num = 1000
    seen: dict[tuple[int, ...], int] = {}
    for seed in range(num):
        request = Request(prompt, 3, SamplingParams(temperature=4.0, top_k=3, seed=seed))
        [out] = tidar_generate(synth.model, [request], accept="rejection")
        seen[tuple(out.token_ids)] = seen.get(tuple(out.token_ids), 0) + 1
    assert set(seen) <= set(exact)
    assert chi_square_test(seen, exact, num).pvalue > 1e-3


# ------------------------------------------------------------- branches and the KV cache


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_branch_equals_brute_force(layout, models):
    """Verify rows = the plain causal forward; branch a = a separate forward of [t_0 .. t_a,
    K masks]; the forward appends all its KV, commit keeps P + a + 1."""
    model = models[layout].model
    prefix, verify, k = [30, 31, 32, 33, 34], [35, 36, 37, 38], 3
    cache = prefilled_cache(model.lm, prefix)
    logits = quadratic_forward(model, cache, verify[0], verify[1:], k)
    n = len(verify) - 1
    assert logits.shape[0] == (n + 1) * (1 + k) == cache.get_seq_length() - len(prefix)
    with torch.inference_mode():
        causal = model.lm(torch.tensor([prefix + verify])).logits[0, len(prefix):].float()
    torch.testing.assert_close(logits[: n + 1], causal, atol=2e-5, rtol=1e-4)
    for a in range(n + 1):
        branch = logits[quadratic_branch_indices(a, n, k)]
        want = _brute_force_branch(model, prefix, verify[: a + 1], k)
        torch.testing.assert_close(branch, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("drafts_case,accepted", [
    ("bootstrap_no_drafts", 0),
    ("none_accepted", 0),
    ("two_accepted", 2),
    ("all_accepted", 4),
])
def test_kv_after_commit_equals_fresh_prefill(drafts_case, accepted, models):
    """After commit the cache holds the AR KV of prefix + t_0 .. t_a, nothing else."""
    model = models["qwen3_tidar_shifted"].model
    prefix = [40, 41, 42, 43, 44, 45]
    n = 0 if drafts_case == "bootstrap_no_drafts" else 4
    verify = [46, 47, 48, 49, 50][: n + 1]
    cache = prefilled_cache(model.lm, prefix)
    quadratic_forward(model, cache, verify[0], verify[1:], model.block_size)
    commit_kv(cache, len(prefix), accepted)
    fresh = prefilled_cache(model.lm, prefix + verify[: accepted + 1])
    assert cache.get_seq_length() == fresh.get_seq_length() == len(prefix) + accepted + 1
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case_name,sampling", [
    ("synth", "greedy"),
    ("synth", "seed1_t0.8"),
    ("nld_with_lora", "seed2_t1_topk_topp"),
    ("qwen3_tidar_shifted", "seed1_t0.8"),
])
def test_decoder_selects_the_brute_force_branch(case_name, sampling, models, synth,
                                                monkeypatch):
    """Each step's drafts are what branch ``a`` (a = the previous step's accepted count)
    drafts when recomputed alone, and each step starts from the AR KV of the committed
    tokens (a fresh causal prefill)."""
    case = synth if case_name == "synth" else models[case_name]
    model, params = case.model, SAMPLINGS[sampling]
    recorder = Recorder()
    monkeypatch.setattr(tidar, "quadratic_forward", recorder)
    request = Request(case.prompts[0], 40, params, case.eos)
    [out] = tidar_generate(model, [request])
    sequence = request.prompt_token_ids + out.token_ids
    skip = 0 if model.logits_shift else 1
    steps = recorder.steps
    assert len(steps) == out.num_forwards
    assert sum(len(s.drafts) for s in steps) == out.num_draft_tokens
    for step, following in pairwise(steps):
        accepted = following.prefix_len - step.prefix_len - 1
        assert step.drafts[:accepted] == sequence[step.prefix_len + 1 :][:accepted]
        branch = _brute_force_branch(model, sequence[: step.prefix_len],
                                     sequence[step.prefix_len :][: accepted + 1], step.num_masks)
        first = step.prefix_len + accepted + 2  # sequence index of the first new draft
        count = len(following.drafts)
        remaining = request.max_tokens - (first - len(request.prompt_token_ids))
        assert count == min(model.max_draft_tokens, remaining - 1)
        want, _ = sample_drafts(branch[skip:][:count], params, first)
        assert following.drafts == want
    for step in steps:
        fresh = prefilled_cache(model.lm, sequence[: step.prefix_len])
        assert step.anchor == sequence[step.prefix_len]
        for (keys, values), layer in zip(step.kv, fresh.layers):
            torch.testing.assert_close(keys, layer.keys, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(values, layer.values, atol=2e-5, rtol=1e-4)


def test_matches_nld_interleaved_layout(models):
    """NLD's quadratic forward interleaves B sub-blocks ``[t_i, <mask> x B]`` at positions
    ``P+i .. P+i+B``; a mask sees the prefix, every sub-block's first token up to its own
    and its own sub-block; a first token sees the prefix and the first tokens up to itself
    (``_get_sbd_inference_quadratic_decoding_block_mask``). Ours is a permutation of it."""
    model = models["nld_with_lora"].model
    b = model.block_size
    prefix, verify = [30, 31, 32, 33], [40, 41, 42, 43, 44][:b]
    p = len(prefix)
    cache = prefilled_cache(model.lm, prefix)
    ours = quadratic_forward(model, cache, verify[0], verify[1:], b)

    width = b + 1  # NLD: sub-block i = [t_i, mask x B]
    idx = torch.arange(b * width)
    block, offset = idx // width, idx % width
    first_tokens = (offset[None, :] == 0) & (block[None, :] <= block[:, None])
    own_block = (block[None, :] == block[:, None]) & (offset[:, None] != 0)
    mask = torch.cat([torch.ones(b * width, p, dtype=torch.bool), first_tokens | own_block], 1)
    ids = torch.tensor([[t] + [model.mask_token_id] * b for t in verify]).flatten()
    cache = prefilled_cache(model.lm, prefix)
    with torch.inference_mode():
        theirs = block_view_logits(model.lm, ids, p + block + offset, cache, mask).float()
    theirs = theirs.view(b, width, -1)
    torch.testing.assert_close(ours[:b], theirs[:, 0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours[b:].view(b, b, -1), theirs[:, 1:], atol=2e-5, rtol=1e-4)


# -------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("case_name,sampling", [
    ("synth", "greedy"),
    ("synth", "seed1_t0.8"),
    ("nld_dream", "seed1_t0.8"),
    ("qwen3_tidar_unshifted", "seed2_t1_topk_topp"),
])
def test_eos_inside_accepted_block(case_name, sampling, models, synth):
    """Pick as stop token a token that an unbounded run emits as the 2nd+ token of a
    multi-token step (and not before): the stopped run equals AR and ends on it, cut inside
    the step's accepted block."""
    case = synth if case_name == "synth" else models[case_name]
    params = SAMPLINGS[sampling]
    for prompt in case.prompts:
        [free] = tidar_generate(case.model, [Request(prompt, 40, params)])
        start, stop = 0, None
        for length in free.accept_lengths:
            for j in range(1, length):
                if free.token_ids[start + j] not in free.token_ids[: start + j]:
                    stop = free.token_ids[start + j]
                    break
            if stop is not None:
                break
            start += length
        if stop is not None:
            break
    else:
        pytest.fail("no multi-token step to place a stop token in")
    [out] = _assert_lossless(case, [Request(prompt, 40, params, (stop,))])
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert out.accept_lengths[-1] >= 2


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11, 17])
def test_max_tokens_mid_block(max_tokens, synth):
    requests = [Request(p, max_tokens, GREEDY) for p in synth.prompts]
    out = _assert_lossless(synth, requests)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in out)


@pytest.mark.parametrize("case_name", ["synth", "qwen3_tidar_shifted", "nld_with_lora"])
def test_context_limit_shrinks_the_branches(case_name, models, synth, monkeypatch):
    """prompt + max_tokens fills the context exactly: no position reaches the limit, the
    last branches are shorter than the block, and the output still equals AR."""
    case = synth if case_name == "synth" else models[case_name]
    prompt = case.prompts[0][:10]
    limit = len(prompt) + 24
    monkeypatch.setattr(case.model.config, "max_position_embeddings", limit)
    recorder = Recorder()
    monkeypatch.setattr(tidar, "quadratic_forward", recorder)
    params = GREEDY if case_name == "synth" else SAMPLINGS["seed1_t0.8"]
    [out] = _assert_lossless(case, [Request(prompt, 24, params)])
    assert len(out.token_ids) == 24
    last_positions = [s.prefix_len + len(s.drafts) + s.num_masks for s in recorder.steps]
    assert max(last_positions) == limit - 1
    assert recorder.steps[-1].num_masks < case.model.max_draft_tokens


# ---------------------------------------------------------------------------- errors


def test_errors(tmp_path, synth):
    with pytest.raises(ValueError, match="drafts 0 .. 8 tokens per step"):
        tidar_generate(synth.model, [Request([5, 6], 4)], num_draft_tokens=9)
    with pytest.raises(CheckpointError, match="no block_size or mask_token_id"):
        load_quadratic(write_qwen3(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match="no block_size in config.json"):
        load_quadratic(write_qwen3(tmp_path / "no_block", mask_token_id=7))
    with pytest.raises(CheckpointError, match="family 'orthrus'"):
        load_quadratic(write_orthrus(tmp_path / "orthrus"))
    with pytest.raises(CheckpointError, match="outside its vocabulary"):
        load_quadratic(write_qwen3(tmp_path / "bad_mask", mask_token_id=999, block_size=4))
    with pytest.raises(ValueError, match="drafts nothing"):
        QuadraticModel(synth.model.lm, 1, 3, logits_shift=False)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        tidar_generate(synth.model, [Request([5] * 500, 20)])
