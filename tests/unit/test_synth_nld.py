"""The bundled synth-nld: a tiny trained NLD whose linear self-speculation is lossless and
accepts drafts (see diffspec/assets/synth-nld/TRAINING.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffspec.assets import SYNTH_NLD_DIR
from diffspec.cli import main
from diffspec.core.checkpoint import inspect_checkpoint, require_method
from diffspec.model_executors.reference.nld import load_nld
from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
from diffspec.testing.synthetic import MASK, build_tokenizer, sample_prompts
from diffspec.train import measure_speculation

pytestmark = pytest.mark.unit

# Mean tokens per draft + verify step on PROMPTS (block 16: at most 16). Measured: the
# shipped LoRA 16.0 (TPF 8.0), the backbone alone (= a fresh LoRA, B = 0) 12.0 (TPF 6.2).
ACCEPT_BOUND = 15.0
PROMPTS = sample_prompts(4, seed=7)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def nld():
    torch.set_num_threads(1)
    return load_nld(SYNTH_NLD_DIR)


@pytest.fixture(scope="module")
def prompt_ids():
    tok = build_tokenizer()
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _measure(nld, model, prompt_ids):
    return measure_speculation(nld.lm, LinearSelfSpecDrafter(model), prompt_ids,
                               nld.block_size - 1, max_tokens=MAX_TOKENS,
                               stop_token_ids=nld.eos_token_ids)


def test_bundled_checkpoint_is_an_nld_with_a_lora():
    info = inspect_checkpoint(SYNTH_NLD_DIR)
    require_method(info, "linear_self_spec")
    assert info.family == "nld" and info.model_type == "nemotron_labs_diffusion"
    assert info.lora_path is not None and (info.lora_path / "adapter_model.safetensors").is_file()
    assert {"encoder.embed_tokens.weight", "diffusion_head.weight"} <= info.weight_names
    assert info.block_size == 16 and not info.logits_shift
    tok = build_tokenizer()  # the synthetic language's ids
    assert info.mask_token_id == tok.convert_tokens_to_ids(MASK)
    assert info.vocab_size == len(tok)
    assert set(info.eos_token_ids) == {tok.convert_tokens_to_ids(t)
                                       for t in ("<|endoftext|>", "<|im_end|>")}


def test_linear_self_spec_equals_ar_and_accepts(nld, prompt_ids):
    assert nld.has_lora
    trained = _measure(nld, nld, prompt_ids)
    assert trained["equal_ar"]
    assert trained["mean_accept_length"] >= ACCEPT_BOUND, trained
    assert trained["tpf"] >= ACCEPT_BOUND / 2, trained


def test_untrained_lora_falls_below_the_bound(nld, prompt_ids):
    """The bound above needs the trained LoRA: drafting with the backbone alone (what a
    freshly initialised LoRA gives) is lossless too but accepts less."""
    untrained = _measure(nld, dataclasses.replace(nld, peft=None), prompt_ids)
    assert untrained["equal_ar"]
    assert untrained["mean_accept_length"] < ACCEPT_BOUND, untrained


def test_cli_generate_on_the_bundled_model(capsys):
    assert main(["generate", "--method", "linear_self_spec", "--prompt",
                 PROMPTS[0], "--max-tokens", "16"]) == 0
    err = capsys.readouterr().err
    assert "[linear_self_spec]" in err and "TPF" in err
