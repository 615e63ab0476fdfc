"""Fast-dLLM's ``attention="block_causal"`` layout (SGLang's dLLM KV layout) for families
trained bidirectionally: blocks from position 0 with the prompt in them, each block seeing
the blocks before it and itself. Checked against a brute-force decoder on the bundled
trained LLaDA (fp32)."""

from __future__ import annotations

import pytest
import torch

from diffspec.assets import SYNTH_DLLM_DIR
from diffspec.core.masks import block_causal_mask
from diffspec.model_executors.reference.dllm import DiffusionLM, load_dllm
from diffspec.spec_workers.reference.decoder import Request
from diffspec.spec_workers.reference.fast_dllm import (
    FastDLLMConfig,
    fast_dllm_generate,
    turn_end_token_ids,
)

BLOCK = 8


@pytest.fixture(scope="module")
def llada() -> DiffusionLM:
    return load_dllm(SYNTH_DLLM_DIR / "llada")


def _prompt(n: int, first: int = 20) -> list[int]:
    return [first + (5 * j) % 150 for j in range(n)]


def _brute_force(lm: DiffusionLM, prompt: list[int], max_tokens: int) -> list[int]:
    """One token per step, no cache: every step runs every slot up to the current block's
    end under the block-causal mask and commits the most confident masked slot of the
    block (never the mask token), until ``max_tokens`` slots are committed."""
    size = (len(prompt) + max_tokens + BLOCK - 1) // BLOCK * BLOCK
    tokens = torch.full((1, size), lm.mask_token_id)
    tokens[0, : len(prompt)] = torch.tensor(prompt)
    limit = len(prompt) + max_tokens
    for start in range(len(prompt) // BLOCK * BLOCK, limit, BLOCK):
        end = start + BLOCK
        while True:
            todo = [j for j in range(max(start, len(prompt)), min(end, limit))
                    if int(tokens[0, j]) == lm.mask_token_id]
            if not todo:
                break
            mask = block_causal_mask(end, BLOCK)[None]
            logits = lm.forward(tokens[:, :end], torch.arange(end)[None], mask)[0]
            logits[:, lm.mask_token_id] = float("-inf")
            probs = logits.softmax(-1)
            best = max(todo, key=lambda j: (float(probs[j].max()), -j))
            tokens[0, best] = int(probs[best].argmax())
    return tokens[0, len(prompt) : limit].tolist()


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(3, 13), (8, 9), (21, 19)])
def test_one_token_per_step_equals_brute_force(llada: DiffusionLM, prompt_len: int,
                                               max_tokens: int) -> None:
    """Prompt inside the first block, on a block boundary, across blocks; ``max_tokens``
    ending mid-block: the prefix cache decodes as the uncached brute force."""
    prompt = _prompt(prompt_len)
    config = FastDLLMConfig(cache="prefix", threshold=1.0, block_size=BLOCK,
                            attention="block_causal")
    out = fast_dllm_generate(llada, [Request(prompt, max_tokens)], config)[0]
    assert out.token_ids == _brute_force(llada, prompt, max_tokens)
    assert out.finish_reason == "length"
    # one token per step, plus one forward that writes each block's KV before the next
    assert [a for a in out.accept_lengths if a] == [1] * max_tokens
    assert out.accept_lengths.count(0) == len(out.steps_per_block) - 1


def test_layout_differs_from_the_trained_one(llada: DiffusionLM) -> None:
    """The option changes what LLaDA sees (its trained canvas is bidirectional)."""
    requests = [Request(_prompt(n), 24) for n in (5, 13, 30)]
    outs = {a: [o.token_ids for o in fast_dllm_generate(
        llada, requests, FastDLLMConfig(threshold=1.0, block_size=BLOCK, attention=a))]
        for a in ("trained", "block_causal")}
    assert outs["trained"] != outs["block_causal"]


@pytest.mark.parametrize("threshold", [0.9, 1.0])
def test_mixed_length_batch_equals_one_by_one(llada: DiffusionLM, threshold: float) -> None:
    """Left padding lines the blocks up; every request decodes as it does alone, forwards
    included (stop token and max_tokens both reached in the batch)."""
    config = FastDLLMConfig(threshold=threshold, block_size=BLOCK, attention="block_causal")
    stop = tuple(llada.eos_token_ids)
    requests = [Request(_prompt(n, first), m, stop_token_ids=stop)
                for n, first, m in ((3, 20, 20), (20, 40, 45), (40, 60, 33), (70, 30, 50))]
    batch = fast_dllm_generate(llada, requests, config)
    alone = [fast_dllm_generate(llada, [r], config)[0] for r in requests]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.num_forwards for o in batch] == [o.num_forwards for o in alone]
    assert [o.finish_reason for o in batch] == [o.finish_reason for o in alone]


def test_bad_attention_value_is_refused() -> None:
    with pytest.raises(ValueError, match="attention must be"):
        FastDLLMConfig(attention="causal")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- turn end

TURN_ENDS = {"llada": "<|eot_id|>", "fast_dllm_v2": "<|im_end|>"}


@pytest.mark.parametrize("family", list(TURN_ENDS))
def test_turn_end_token_is_read_from_the_chat_template(family: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SYNTH_DLLM_DIR / family)
    want = tokenizer.convert_tokens_to_ids(TURN_ENDS[family])
    assert turn_end_token_ids(tokenizer) == (want,)
    tokenizer.chat_template = None
    assert turn_end_token_ids(tokenizer) == ()


def test_reference_decoder_stops_at_the_turn_end() -> None:
    """LLaDA's turn end (``<|eot_id|>``) is not its config's EOS (``<|endoftext|>``); the
    registry's reference decoder stops on both."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference import load_decoder

    decoder = load_decoder("fast_dllm", SYNTH_DLLM_DIR / "llada")
    eot = decoder.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot not in inspect_checkpoint(SYNTH_DLLM_DIR / "llada").eos_token_ids
    assert eot in decoder.stop_token_ids
    assert set(inspect_checkpoint(SYNTH_DLLM_DIR / "llada").eos_token_ids) <= set(
        decoder.stop_token_ids)
