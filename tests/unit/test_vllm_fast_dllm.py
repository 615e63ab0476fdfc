"""Fast-dLLM on vLLM's diffusion path, the parts that need no engine
(:mod:`diffspec.spec_workers.vllm.fast_dllm`, :mod:`diffspec.model_executors.vllm.llada`,
:mod:`diffspec.plugin.vllm.dllm`): the step rules on hand-built logits, the LLaDA tensor
names, the block choice, and the per-request data path vLLM runs (causal prefill, then per
block: non-causal denoise forwards over the prefix KV with nothing kept, then a completing
forward whose KV is kept) driven by those rules on the bundled trained LLaDA, which must
give the reference decoder's tokens and forward counts for the same layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")

from diffspec.assets import SYNTH_DLLM_DIR
from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
from diffspec.model_executors.reference.dllm import DiffusionLM, load_dllm
from diffspec.model_executors.vllm.llada import llada_to_vllm_name
from diffspec.plugin.vllm.dllm import DEFAULT_BLOCK, diffusion_block_size
from diffspec.spec_workers.reference.decoder import Request
from diffspec.spec_workers.reference.fast_dllm import (
    FastDLLMConfig,
    fast_dllm_generate,
)
from diffspec.spec_workers.vllm.fast_dllm import (
    BlockState,
    block_outcome,
    request_stops,
    unmask_block,
)

M = 9  # mask token id of the hand-built cases
VOCAB = 12


def _logits(*rows: dict[int, float]) -> torch.Tensor:
    """[1, len(rows), VOCAB]: row j puts its dict's logits on those tokens, 0 elsewhere."""
    out = torch.zeros(1, len(rows), VOCAB)
    for j, row in enumerate(rows):
        for token, value in row.items():
            out[0, j, token] = value
    return out


# ---------------------------------------------------------------------------- unmask_block


def test_unmask_top1_only_commits_the_most_confident_slot() -> None:
    logits = _logits({1: 5.0}, {2: 9.0}, {3: 7.0})
    canvas = torch.full((1, 3), M)
    new, committed = unmask_block(logits, canvas, torch.tensor([3]), M, threshold=1.0)
    assert new.tolist() == [[M, 2, M]]
    assert committed.tolist() == [[False, True, False]]


def test_unmask_threshold_commits_every_confident_slot() -> None:
    logits = _logits({1: 20.0}, {2: 20.0}, {3: 0.5})
    new, _ = unmask_block(logits, torch.full((1, 3), M), torch.tensor([3]), M, threshold=0.9)
    assert new.tolist() == [[1, 2, M]]


def test_unmask_never_predicts_the_mask_token() -> None:
    logits = _logits({M: 50.0, 4: 1.0})
    new, _ = unmask_block(logits, torch.full((1, 1), M), torch.tensor([1]), M, threshold=0.9)
    assert new.tolist() == [[4]]


def test_unmask_leaves_slots_past_the_limit_masked() -> None:
    logits = _logits({1: 1.0}, {2: 30.0}, {3: 30.0})
    new, _ = unmask_block(logits, torch.full((1, 3), M), torch.tensor([1]), M, threshold=0.9)
    assert new.tolist() == [[1, M, M]]


def test_unmask_keeps_committed_slots() -> None:
    logits = _logits({5: 30.0}, {6: 30.0})
    new, committed = unmask_block(logits, torch.tensor([[7, M]]), torch.tensor([2]), M, 0.9)
    assert new.tolist() == [[7, 6]] and committed.tolist() == [[False, True]]


# ---------------------------------------------------------------------------- block_outcome

EOS = 3
OUTCOMES = {
    # name: (canvas, limit, ends_here, (emit, complete))
    "still_masked": ([1, M, 2, 4], 4, False, (0, False)),
    "stop_with_nothing_masked_before": ([1, EOS, M, M], 4, False, (2, False)),
    "stop_after_a_mask_waits": ([1, M, EOS, 4], 4, False, (0, False)),
    "stop_at_first_slot": ([EOS, M, M, M], 4, True, (1, False)),
    "block_done_request_goes_on": ([1, 2, 4, 5], 4, False, (0, True)),
    "max_tokens_end_in_block": ([1, 2, M, M], 2, True, (2, False)),
    "max_tokens_end_on_block_edge": ([1, 2, 4, 5], 4, True, (4, False)),
    "stop_past_the_limit_ignored": ([1, 2, EOS, M], 2, True, (2, False)),
}


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_block_outcome(name: str) -> None:
    canvas, limit, ends_here, expected = OUTCOMES[name]
    got = block_outcome(torch.tensor(canvas), limit, ends_here, torch.tensor([EOS]), M)
    assert got == expected


def test_block_limit_counts_emitted_blocks() -> None:
    state = BlockState(max_tokens=10, stops=torch.tensor([EOS]), threshold=0.9,
                       canvas=torch.full((4,), M))
    assert state.limit(4) == (4, False)
    state.generated = 8
    assert state.limit(4) == (2, True)


def test_request_stops_follow_ignore_eos() -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, stop_token_ids=[7])
    params.update_from_generation_config({}, eos_token_id=1)
    assert request_stops(params) == [1, 7]
    ignored = SamplingParams(max_tokens=4, stop_token_ids=[7], ignore_eos=True)
    ignored.update_from_generation_config({}, eos_token_id=1)
    assert request_stops(ignored) == [7]


# ---------------------------------------------------------------------------- model, config


def test_llada_names_map_onto_vllm_llama() -> None:
    from safetensors import safe_open

    with safe_open(str(SYNTH_DLLM_DIR / "llada" / "model.safetensors"), "pt") as f:
        names = {llada_to_vllm_name(n) for n in f.keys()}  # noqa: SIM118 (not iterable)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.self_attn.o_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    with pytest.raises(CheckpointError, match="unexpected LLaDA tensor"):
        llada_to_vllm_name("model.transformer.blocks.0.alibi.weight")


def test_diffusion_block_size() -> None:
    info = inspect_checkpoint(SYNTH_DLLM_DIR / "llada")
    assert diffusion_block_size(info, None) == DEFAULT_BLOCK
    assert diffusion_block_size(info, 8) == 8
    v2 = inspect_checkpoint(SYNTH_DLLM_DIR / "fast_dllm_v2")
    assert diffusion_block_size(v2, None) == v2.block_size


# ---------------------------------------------------------------------------- data path


@pytest.fixture(scope="module")
def llada() -> DiffusionLM:
    return load_dllm(SYNTH_DLLM_DIR / "llada")


def _vllm_data_path(lm: DiffusionLM, request: Request, block: int,
                    threshold: float) -> tuple[list[int], int]:
    """One request the way vLLM's diffusion path runs it with the Fast-dLLM model state:
    ``(tokens, forwards)``."""
    prompt = torch.tensor([request.prompt_token_ids])
    n = prompt.shape[1]
    cache = lm.new_cache()
    lm.forward(prompt, torch.arange(n)[None], torch.ones(n, n).tril().bool()[None], cache,
               keep_kv=True)  # vLLM's causal prefill
    state = BlockState(max_tokens=request.max_tokens, threshold=threshold,
                       stops=torch.tensor(request.stop_token_ids, dtype=torch.long),
                       canvas=torch.full((block,), lm.mask_token_id))
    out, forwards, start = [], 1, n
    while True:
        positions = torch.arange(start, start + block)[None]
        visible = torch.ones(1, block, start + block, dtype=torch.bool)  # prefix + block
        logits = lm.forward(state.canvas[None], positions, visible, cache)  # denoise
        forwards += 1
        limit, ends_here = state.limit(block)
        state.canvas = unmask_block(logits, state.canvas[None], torch.tensor([limit]),
                                    lm.mask_token_id, threshold)[0][0]
        emit, complete = block_outcome(state.canvas, limit, ends_here, state.stops,
                                       lm.mask_token_id)
        if emit:
            return out + state.canvas[:emit].tolist(), forwards
        if complete:  # the completing forward: the block's KV kept, its tokens emitted
            lm.forward(state.canvas[None], positions, visible, cache, keep_kv=True)
            forwards += 1
            out += state.canvas.tolist()
            state.generated += block
            state.canvas = torch.full((block,), lm.mask_token_id)
            start += block


@pytest.mark.parametrize("threshold", [0.9, 1.0])
def test_data_path_matches_reference_decoder(llada: DiffusionLM, threshold: float) -> None:
    block = 8
    eos = llada.eos_token_ids[0]
    requests = [Request([20 + (7 * j) % 150 for j in range(n)], max_tokens=m,
                        stop_token_ids=(eos,)) for n, m in ((3, 13), (11, 20), (26, 8))]
    # the reference's block-causal layout with a causal prompt (NLD's diffusion mode)
    lm = replace(llada, attention="block_causal", causal_prefix=True)
    expected = fast_dllm_generate(lm, requests, FastDLLMConfig(
        cache="prefix", threshold=threshold, block_size=block))
    for request, ref in zip(requests, expected):
        tokens, forwards = _vllm_data_path(lm, request, block, threshold)
        assert tokens == ref.token_ids
        assert forwards == ref.num_forwards
