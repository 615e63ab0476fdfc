"""The reference decoder: AR equals transformers' generate; speculative equals AR.

Models: the bundled synth-qwen3 (trained on the synthetic language, drafts often right) and
a random tiny Qwen3 built here (drafts mostly rejected). Everything runs in fp32 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from diffspec.assets import SYNTH_QWEN3_DIR
from diffspec.core.sampling import SamplingParams
from diffspec.spec_workers.reference.decoder import (
    NgramDrafter,
    Request,
    RequestOutput,
    ar_generate,
    speculative_generate,
)
from diffspec.testing.stats import chi_square_test
from diffspec.testing.synthetic import sample_prompts

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def synth():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = SYNTH_QWEN3_DIR
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    eos = tuple(model.generation_config.eos_token_id)
    return model, tokenizer, eos


def tiny_random_qwen3(vocab_size: int = 64, seed: int = 0, init: float = 0.02,
                      max_pos: int = 128):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=max_pos, initializer_range=init, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def random_model():
    return tiny_random_qwen3(init=0.2)


def _prompts(synth, n: int = 4, seed: int = 7) -> list[list[int]]:
    _, tokenizer, _ = synth
    return [tokenizer(p)["input_ids"] for p in sample_prompts(n, seed)]


def _requests(prompts: list[list[int]], sampling: SamplingParams, max_tokens: int,
              stops: tuple[int, ...] = ()) -> list[Request]:
    return [Request(p, max_tokens, sampling, stops) for p in prompts]


@dataclass
class ListDrafter:
    """Proposes a fixed continuation (the oracle's own output), then junk."""

    continuation: list[int]
    prompt_len: int
    junk: int = 5
    forwards_per_propose: int = 0

    def propose(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], Tensor | None]:
        done = len(token_ids) - self.prompt_len
        drafts = self.continuation[done:] + [self.junk] * num_tokens
        return drafts[:num_tokens], None


@dataclass
class SampledDrafter:
    """Draws each draft from a fixed distribution ``q`` and reports ``q`` (non-point-mass)."""

    q: Tensor  # [vocab]
    generator: torch.Generator
    forwards_per_propose: int = 0

    def propose(self, token_ids: list[int], num_tokens: int) -> tuple[list[int], Tensor | None]:
        drafts = torch.multinomial(self.q, num_tokens, replacement=True, generator=self.generator)
        return drafts.tolist(), self.q.expand(num_tokens, -1)


# ------------------------------------------------------------------------ AR vs transformers


def test_ar_greedy_matches_transformers_generate_synth(synth):
    model, _, eos = synth
    for prompt in _prompts(synth, n=3):
        [out] = ar_generate(model, [Request(prompt, 40, GREEDY, eos)])
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                             eos_token_id=list(eos), pad_token_id=eos[0])
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.num_forwards == len(out.token_ids) and out.tpf == 1.0


def test_ar_greedy_matches_transformers_generate_random(random_model):
    prompt = [3, 9, 27, 17, 51, 25]
    [out] = ar_generate(random_model, [Request(prompt, 24)])
    ref = random_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                                eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt):].tolist()
    assert out.finish_reason == "length"


# -------------------------------------------------------------------- speculative == AR

LOSSLESS_CASES = {
    # name: (model, sampling, num_draft_tokens, max_tokens)
    "greedy_synth_k8": ("synth", GREEDY, 8, 48),
    "greedy_synth_k3": ("synth", GREEDY, 3, 48),
    "coupled_synth_seed0": ("synth", SamplingParams(temperature=1.0, seed=0), 6, 48),
    "coupled_synth_seed1_topk_topp": (
        "synth", SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1), 6, 48),
    "greedy_random_k4": ("random", GREEDY, 4, 32),
    "coupled_random_seed0": ("random", SamplingParams(temperature=1.0, seed=0), 4, 32),
    "coupled_random_seed1": ("random", SamplingParams(temperature=0.7, seed=1), 4, 32),
}


@pytest.mark.parametrize("name", list(LOSSLESS_CASES))
def test_speculative_equals_ar(name, request):
    which, sampling, k, max_tokens = LOSSLESS_CASES[name]
    if which == "synth":
        synth = request.getfixturevalue("synth")
        model, _, eos = synth
        prompts = _prompts(synth, n=4) + [_prompts(synth, n=1, seed=3)[0][:5]]  # mixed lengths
    else:
        model, eos = request.getfixturevalue("random_model"), ()
        prompts = [[1, 2, 3, 1, 2], [7], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]]
    requests = _requests(prompts, sampling, max_tokens, eos)
    ar = ar_generate(model, requests)
    spec = speculative_generate(model, NgramDrafter(), requests, num_draft_tokens=k)
    for a, s in zip(ar, spec):
        assert s.token_ids == a.token_ids
        assert s.finish_reason == a.finish_reason
        assert sum(s.accept_lengths) == len(s.token_ids)
        assert s.num_forwards == len(s.accept_lengths) <= a.num_forwards
    if which == "random":  # drafts are proposed, mostly rejected, and the output still matches
        assert sum(s.num_draft_tokens for s in spec) > 0
        assert sum(s.num_accepted_tokens for s in spec) < sum(s.num_draft_tokens for s in spec)


def test_trained_model_drafts_get_accepted(synth):
    """Not a timing assert: the n-gram drafter's drafts are mostly right on this language."""
    model, _, eos = synth
    requests = _requests(_prompts(synth, n=6, seed=11), GREEDY, 64, eos)
    spec = speculative_generate(model, NgramDrafter(), requests, num_draft_tokens=8)
    steps = sum(len(s.accept_lengths) for s in spec)
    mean_accept_length = sum(len(s.token_ids) for s in spec) / steps
    assert mean_accept_length > 1.5, [s.accept_lengths for s in spec]


# -------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_max_tokens_ends_mid_block(max_tokens, synth):
    model, _, _ = synth
    prompt = _prompts(synth, n=1)[0]
    request = Request(prompt, max_tokens)  # no stop tokens: only the length stops it
    [full] = ar_generate(model, [Request(prompt, 40)])
    [spec] = speculative_generate(model, ListDrafter(full.token_ids, len(prompt)), [request], 8)
    assert spec.token_ids == full.token_ids[:max_tokens]
    assert spec.finish_reason == "length"
    assert spec.num_forwards == -(-max_tokens // 9)  # drafts are capped, never emitted past


def test_eos_inside_accepted_block(synth):
    """Drafts run past the EOS; the output stops right after it."""
    model, tokenizer, eos = synth
    for prompt in _prompts(synth, n=8, seed=5):
        [ar] = ar_generate(model, [Request(prompt, 120, GREEDY, eos)])
        if ar.finish_reason == "stop":
            break
    else:
        pytest.fail("no prompt whose AR continuation ends with EOS")
    assert ar.token_ids[-1] in eos
    k = len(ar.token_ids) + 4  # one block covers the whole continuation and more
    drafter = ListDrafter(ar.token_ids, len(prompt))
    [spec] = speculative_generate(model, drafter, [Request(prompt, 120, GREEDY, eos)], k)
    assert spec.token_ids == ar.token_ids
    assert spec.finish_reason == "stop"
    assert spec.num_forwards == 1 and spec.accept_lengths == [len(ar.token_ids)]


@pytest.mark.parametrize("method", ["ar", "ngram"])
def test_stop_strings(method, synth):
    model, tokenizer, eos = synth
    prompt = _prompts(synth, n=1)[0]
    [full] = ar_generate(model, [Request(prompt, 30, GREEDY, eos)])
    word = tokenizer.decode(full.token_ids[6:7])
    # Expected: the shortest output whose decoded text contains the stop string.
    cut = next(i for i in range(1, 31) if word in tokenizer.decode(full.token_ids[:i]))
    assert cut <= 7
    request = Request(prompt, 30, GREEDY, eos, stop_strings=(word,))
    if method == "ar":
        [out] = ar_generate(model, [request], tokenizer=tokenizer)
    else:
        [out] = speculative_generate(model, NgramDrafter(), [request], 8, tokenizer=tokenizer)
    assert out.token_ids == full.token_ids[:cut]
    assert out.finish_reason == "stop"


def test_context_limit_shrinks_the_block():
    model = tiny_random_qwen3(max_pos=24, init=0.2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]
    requests = [Request(prompt, 24 - len(prompt))]  # exactly fills the context
    [ar] = ar_generate(model, requests)
    [spec] = speculative_generate(model, NgramDrafter(), requests, num_draft_tokens=8)
    assert spec.token_ids == ar.token_ids and len(spec.token_ids) == 12


# ------------------------------------------------------- rejection sampling: distribution


def _exact_two_token_distribution(model, prompt: list[int], temperature: float) -> Tensor:
    """P(t1, t2 | prompt) under the model at ``temperature``: [vocab, vocab]."""
    with torch.inference_mode():
        vocab = model.config.vocab_size
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [t] for t in range(vocab)])  # [vocab, len + 1]
        p2 = torch.softmax(model(seqs).logits[:, -1] / temperature, -1)  # [vocab, vocab]
    return p1[:, None] * p2


def _chi_square_pvalue(observed: Tensor, expected_probs: Tensor, num_runs: int) -> float:
    """Pearson chi-square (:func:`diffspec.testing.stats.chi_square_test`)."""
    return chi_square_test(observed, expected_probs, num_runs).pvalue


@pytest.mark.parametrize("drafter_kind", ["ar_coupled", "rejection_pointmass", "rejection_q"])
def test_sampling_reproduces_target_distribution(drafter_kind):
    """The first two generated tokens over 600 seeded runs follow P(t1, t2) exactly.

    Under the null (a correct sampler), Pearson's statistic is chi-square distributed (cells
    with expected count < 5 pooled), so a correct implementation fails this with probability
    1e-3 over seed sets; the seeds are fixed, so the test is deterministic. The distribution
    is far from uniform and far from the drafts' q (asserted), so a sampler that accepted
    drafts blindly would fail by a wide margin.
    """
    vocab, temperature, num_runs = 8, 1.0, 600
    model = tiny_random_qwen3(vocab_size=vocab, init=0.5, seed=1)
    prompt = [1, 2, 3, 1, 2]
    exact = _exact_two_token_distribution(model, prompt, temperature)  # [vocab, vocab]
    q = torch.softmax(torch.arange(vocab, dtype=torch.float32) * 0.4, -1)  # [vocab]
    q2 = q[:, None] * q[None, :]
    assert 0.5 * (exact - q2).abs().sum() > 0.3  # the target is far from the drafts

    counts = torch.zeros(vocab, vocab)
    for seed in range(num_runs):
        sampling = SamplingParams(temperature=temperature, seed=seed)
        request = Request(prompt, 3, sampling)
        if drafter_kind == "ar_coupled":
            [out] = ar_generate(model, [request])
        elif drafter_kind == "rejection_pointmass":
            [out] = speculative_generate(model, NgramDrafter(), [request], 2, accept="rejection")
        else:
            drafter = SampledDrafter(q, torch.Generator().manual_seed(10_000 + seed))
            [out] = speculative_generate(model, drafter, [request], 2, accept="rejection")
        counts[out.token_ids[0], out.token_ids[1]] += 1
    pvalue = _chi_square_pvalue(counts, exact, num_runs)
    assert pvalue > 1e-3, (pvalue, counts, exact * num_runs)
    # Power: the same counts reject a target only 0.16 away in TV (temperature 1.5).
    wrong = _exact_two_token_distribution(model, prompt, 1.5)
    assert _chi_square_pvalue(counts, wrong, num_runs) < 1e-3


# ------------------------------------------------------------------------ bad parameters

BAD_REQUESTS = {
    "empty_prompt": dict(prompt_token_ids=[]),
    "max_tokens_zero": dict(max_tokens=0),
    "max_tokens_not_int": dict(max_tokens=2.5),
    "negative_token_id": dict(prompt_token_ids=[1, -3]),
    "empty_stop_string": dict(stop_strings=("",)),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_raises(name):
    kwargs = dict(prompt_token_ids=[1, 2], max_tokens=4) | BAD_REQUESTS[name]
    with pytest.raises(ValueError):
        Request(**kwargs)


BAD_RUNS = {
    "prompt_plus_max_tokens_too_long": (Request([1] * 100, 29), "auto", "exceeds"),
    "token_id_out_of_vocab": (Request([1, 64], 4), "auto", "vocab_size"),
    "greedy_accept_for_sampled": (
        Request([1, 2], 4, SamplingParams(temperature=1.0, seed=0)), "greedy", "greedy"),
    "coupled_without_seed": (Request([1, 2], 4, SamplingParams(temperature=1.0)), "coupled",
                             "seed"),
    "stop_strings_without_tokenizer": (Request([1, 2], 4, stop_strings=("x",)), "auto",
                                       "tokenizer"),
}


@pytest.mark.parametrize("name", list(BAD_RUNS))
def test_bad_run_raises(name, random_model):
    request, accept, message = BAD_RUNS[name]
    with pytest.raises(ValueError, match=message):
        speculative_generate(random_model, NgramDrafter(), [request], 4, accept=accept)


def test_bad_sampling_params_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


# ------------------------------------------------------------------ drafter and output

NGRAM_CASES = {
    # name: (token_ids, num_tokens, expected drafts)
    "no_match": ([1, 2, 3, 4], 3, []),
    "trigram_most_recent": ([1, 2, 3, 7, 1, 2, 3, 8, 9, 1, 2, 3], 2, [8, 9]),
    "falls_back_to_unigram": ([5, 6, 7, 8, 4, 6], 3, [7, 8, 4]),
    "truncated_at_end": ([1, 2, 9, 1, 2], 4, [9, 1, 2]),
    "zero_tokens": ([1, 1, 1], 0, []),
}


@pytest.mark.parametrize("name", list(NGRAM_CASES))
def test_ngram_drafter(name):
    token_ids, num_tokens, expected = NGRAM_CASES[name]
    drafts, probs = NgramDrafter(n_max=3, n_min=1).propose(token_ids, num_tokens)
    assert drafts == expected and probs is None


def test_request_output_metrics():
    out = RequestOutput(token_ids=list(range(7)), finish_reason="length", num_forwards=3,
                        accept_lengths=[1, 4, 2])
    assert out.tpf == pytest.approx(7 / 3)
    assert out.mean_accept_length == pytest.approx(7 / 3)
    assert out.acceptance_histogram == [0, 1, 1, 0, 1]
