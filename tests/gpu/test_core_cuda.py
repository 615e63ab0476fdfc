"""GPU tier: the core rules and the reference decoder give the same results on CUDA as
on CPU (skipped without CUDA; see tests/conftest.py)."""

from __future__ import annotations

import torch

from diffspec.core.accept import coupled_accept, greedy_accept, rejection_sample_accept
from diffspec.core.sampling import SamplingParams, position_gumbel_noise, process_logits


def test_accept_rules_match_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 32, generator=gen)  # [batch, n + 1, vocab]
    drafts = logits[:, :4].argmax(-1)  # [batch, n]
    drafts[1, 2] = (drafts[1, 2] + 1) % 32
    drafts[2, 3] = -1
    cpu = greedy_accept(drafts, logits)
    gpu = greedy_accept(drafts.cuda(), logits.cuda())
    assert torch.equal(cpu.output_token_ids, gpu.output_token_ids.cpu())

    processed = process_logits(logits, 0.8, 8, 0.9)
    noise = torch.stack([position_gumbel_noise(7, list(range(10, 15)), 32)] * 3)
    cpu = coupled_accept(drafts, processed, noise)
    gpu = coupled_accept(drafts.cuda(), processed.cuda(), noise.cuda())
    assert torch.equal(cpu.output_token_ids, gpu.output_token_ids.cpu())

    # rejection sampling on CUDA (CUDA generators): a target that puts all its mass on the
    # drafts accepts every draft and draws the bonus from its last row; one that gives a
    # draft no mass rejects it and draws the recovered token from the target there
    target = torch.zeros(3, 5, 32)
    target[torch.arange(3)[:, None], torch.arange(4)[None, :], drafts.clamp(min=0)] = 1.0
    target[:, 4, 9] = 1.0  # bonus row: token 9
    target[2, 3, :] = 0.0
    target[2, 3, 17] = 1.0  # request 2 has 3 drafts: its bonus row is row 3
    target[1, 2, :] = 0.0
    target[1, 2, 21] = 1.0  # request 1's third draft has no mass: rejected, 21 recovered
    out = rejection_sample_accept(drafts.cuda(), None, target.cuda(),
                                  generators=torch.Generator("cuda").manual_seed(1))
    assert out.output_token_ids.device.type == "cuda"
    assert out.num_accepted.tolist() == [4, 2, 3]
    assert out.tokens(0) == [*drafts[0].tolist(), 9]
    assert out.tokens(1) == [*drafts[1, :2].tolist(), 21]
    assert out.tokens(2) == [*drafts[2, :3].tolist(), 17]


def test_reference_ar_decoder_matches_cpu() -> None:
    from transformers import AutoModelForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR
    from diffspec.spec_workers.reference.decoder import (
        NgramDrafter,
        Request,
        ar_generate,
        speculative_generate,
    )

    requests = [
        Request(prompt_token_ids=list(range(5, 5 + n)), max_tokens=24, sampling=params)
        for n, params in [(3, SamplingParams()), (11, SamplingParams(temperature=1.0, seed=3))]
    ]
    cpu_model = AutoModelForCausalLM.from_pretrained(SYNTH_QWEN3_DIR, dtype=torch.float32)
    gpu_model = AutoModelForCausalLM.from_pretrained(SYNTH_QWEN3_DIR, dtype=torch.float32).cuda()
    cpu = [r.token_ids for r in ar_generate(cpu_model, requests)]
    gpu = [r.token_ids for r in ar_generate(gpu_model, requests)]
    spec = [r.token_ids for r in speculative_generate(gpu_model, NgramDrafter(), requests, 8)]
    assert gpu[0] == cpu[0]  # greedy: identical across devices on this model
    assert spec == gpu  # lossless on the GPU too
