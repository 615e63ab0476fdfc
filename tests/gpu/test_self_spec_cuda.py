"""GPU tier: self-speculation stays lossless on CUDA (spec output == plain AR output on the
same device, token for token, fp32), greedy and seeded, for a batch of mixed-length prompts
straddling the block, with drafts accepted; and the bf16 match rate against fp32 is
reported (bf16 reorders reductions, so it is a rate, not an equality).

Skipped without CUDA (tests/conftest.py). Run: ``pytest tests/gpu -q -s``.
"""

from __future__ import annotations

import pytest
import torch

from diffspec.assets import SYNTH_QWEN3_DIR
from diffspec.model_executors.reference.nld import load_nld
from diffspec.model_executors.reference.orthrus import orthrus_from_base
from diffspec.spec_workers.reference.decoder import (
    BlockDrafter,
    Request,
    ar_generate,
    speculative_generate,
)
from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
from diffspec.testing.checkpoints import write_nld
from diffspec.testing.synthetic import sample_prompts
from tests.unit.lossless_cases import SAMPLINGS

DEVICE = "cuda"


def _synth_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SYNTH_QWEN3_DIR))
    prompts = [tokenizer(p)["input_ids"] for p in sample_prompts(4, 7)]
    return [*prompts, prompts[0][:3]]  # a short one among long ones


@pytest.fixture(scope="module")
def orthrus():
    model = orthrus_from_base(SYNTH_QWEN3_DIR, block_size=16)
    model.lm.to(DEVICE)
    return model


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_orthrus_lossless_on_cuda(sampling, orthrus) -> None:
    requests = [Request(p, 40, SAMPLINGS[sampling], orthrus.eos_token_ids)
                for p in _synth_prompts()]
    ar = ar_generate(orthrus.lm, requests)
    spec = speculative_generate(orthrus.lm, BlockDrafter(orthrus), requests, 15)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]
    assert [s.finish_reason for s in spec] == [a.finish_reason for a in ar]
    assert sum(s.num_accepted_tokens for s in spec) > 0  # drafts were accepted, not only rejected


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_nld_linear_self_spec_lossless_on_cuda(sampling, tmp_path) -> None:
    nld = load_nld(write_nld(tmp_path / "nld", with_lora=True), lora=True)
    nld.lm.to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(20, 200, (n,), generator=gen).tolist() for n in (1, 5, 31, 33)]
    requests = [Request(p, 12, SAMPLINGS[sampling], nld.eos_token_ids) for p in prompts]
    ar = ar_generate(nld.lm, requests)
    spec = speculative_generate(nld.lm, LinearSelfSpecDrafter(nld), requests, 7)
    assert [s.token_ids for s in spec] == [a.token_ids for a in ar]


def test_orthrus_bf16_match_rate_reported(orthrus) -> None:
    """bf16 spec vs fp32 AR: the share of tokens equal up to the first difference, printed
    (``-s``). bf16 is not promised exact, so the assertion is a floor that a broken bf16
    path (garbage from the first tokens) cannot reach: half the tokens."""
    requests = [Request(p, 40, SAMPLINGS["greedy"], orthrus.eos_token_ids)
                for p in _synth_prompts()]
    ar = ar_generate(orthrus.lm, requests)
    bf16 = orthrus_from_base(SYNTH_QWEN3_DIR, block_size=16)
    bf16.lm.to(DEVICE, torch.bfloat16)
    spec = speculative_generate(bf16.lm, BlockDrafter(bf16), requests, 15)
    same = total = 0
    for s, a in zip(spec, ar):
        prefix = next((i for i, (x, y) in enumerate(zip(s.token_ids, a.token_ids)) if x != y),
                      min(len(s.token_ids), len(a.token_ids)))
        same, total = same + prefix, total + len(a.token_ids)
    print(f"\n[gpu] Orthrus bf16 spec vs fp32 AR on {torch.cuda.get_device_name()}: "
          f"{same}/{total} tokens match before the first difference ({same / total:.1%})")
    assert total > 0 and all(len(s.token_ids) > 0 for s in spec)
    assert same / total >= 0.5, f"bf16 matches fp32 on {same}/{total} tokens only"
