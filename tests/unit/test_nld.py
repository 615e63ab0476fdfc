"""The NLD model executor: the published layout loaded into a stock Ministral3, the draft
LoRA active only in the draft pass, unshifted (LLaDA) or shifted (Dream) draft logits,
no KV written by a draft, clear errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diffspec.cli import main
from diffspec.core.checkpoint import CheckpointError
from diffspec.model_executors.reference.nld import load_nld
from diffspec.model_executors.reference.views import block_view_logits
from diffspec.spec_workers.reference.decoder import Request, speculative_generate
from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
from diffspec.testing.checkpoints import write_nld, write_orthrus
from tests.unit.kv import prefilled_cache

IDS = torch.tensor([[20, 21, 22, 23, 24, 25]])


@pytest.fixture(scope="module")
def nld_path(tmp_path_factory):
    return write_nld(tmp_path_factory.mktemp("nld") / "nld")


@pytest.fixture(scope="module")
def with_lora(nld_path):
    return load_nld(nld_path)


@pytest.fixture(scope="module")
def without_lora(nld_path):
    return load_nld(nld_path, lora=False)


def _lora_flags(model) -> set[bool]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {m.disable_adapters for m in model.lm.modules() if isinstance(m, BaseTunerLayer)}


def test_config_fields(with_lora, without_lora):
    assert with_lora.has_lora and not without_lora.has_lora
    assert (with_lora.block_size, with_lora.mask_token_id) == (32, 14)  # "[MASK]"
    assert with_lora.eos_token_ids == (2,) and not with_lora.logits_shift
    rope = with_lora.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["llama_4_scaling_beta"] == 0.1


def test_backbone_is_the_published_encoder_and_head(nld_path, without_lora):
    """Built by hand from the file's ``encoder.*`` and ``diffusion_head.weight``."""
    from transformers import Ministral3Model

    tensors = load_file(str(nld_path / "model.safetensors"))
    encoder = Ministral3Model(without_lora.config).eval()
    encoder.load_state_dict({k[len("encoder."):]: v for k, v in tensors.items()
                             if k.startswith("encoder.")})
    with torch.no_grad():
        want = encoder(IDS).last_hidden_state @ tensors["diffusion_head.weight"].T
        got = without_lora.lm(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_lora_weights_are_loaded(nld_path, with_lora):
    saved = load_file(str(nld_path / "linear_spec_lora" / "adapter_model.safetensors"))
    o_proj = with_lora.lm.model.layers[1].self_attn.o_proj
    key = "base_model.model.encoder.layers.1.self_attn.o_proj.lora_{}.weight"
    assert torch.equal(o_proj.lora_A["default"].weight, saved[key.format("A")])
    assert torch.equal(o_proj.lora_B["default"].weight, saved[key.format("B")])


def test_lora_is_active_only_in_the_draft_pass(with_lora, without_lora):
    """Verify (AR) logits are the plain model's with the LoRA attached, before and after a
    draft; draft logits differ with the LoRA on vs off."""
    with torch.no_grad():
        plain = without_lora.lm(IDS).logits
        assert torch.equal(with_lora.lm(IDS).logits, plain)
        assert _lora_flags(with_lora) == {True}  # adapters disabled outside drafting
        with with_lora.draft_view():
            assert _lora_flags(with_lora) == {False}
        drafted_with = with_lora.draft_logits(
            25, prefilled_cache(with_lora.lm, [20, 21, 22, 23, 24]), 6)
        drafted_without = without_lora.draft_logits(
            25, prefilled_cache(without_lora.lm, [20, 21, 22, 23, 24]), 6)
        assert torch.equal(with_lora.lm(IDS).logits, plain)
    assert _lora_flags(with_lora) == {True}
    assert (drafted_with - drafted_without).abs().max() > 1e-3


@pytest.mark.parametrize("dlm_type,shifted", [(None, False), ("llada", False),
                                              ("dream", True)])
def test_draft_logits_shift_and_no_kv_write(dlm_type, shifted, tmp_path):
    path = write_nld(tmp_path / "nld", dlm_type=dlm_type)
    model = load_nld(path)
    assert model.logits_shift == shifted
    cache = prefilled_cache(model.lm, [20, 21, 22, 23])
    keys = cache.layers[0].keys.clone()
    with torch.no_grad():
        drafts = model.draft_logits(24, cache, 5)  # [5, vocab]
        block = torch.tensor([24] + [model.mask_token_id] * 5)
        with model.draft_view():
            logits = block_view_logits(model.lm, block, torch.arange(4, 10), cache)
    assert cache.get_seq_length() == 4 and torch.equal(cache.layers[0].keys, keys)
    assert torch.equal(drafts, logits[:-1] if shifted else logits[1:])


def test_draft_pass_is_bidirectional(with_lora):
    """The first block position sees the masks after it: changing the block's length
    changes its logits (a causal pass would not)."""
    cache = prefilled_cache(with_lora.lm, [20, 21, 22, 23])
    with torch.no_grad(), with_lora.draft_view():
        short = block_view_logits(with_lora.lm, torch.tensor([24, 14]), torch.arange(4, 6), cache)
        long = block_view_logits(with_lora.lm, torch.tensor([24, 14, 14, 14]),
                                 torch.arange(4, 8), cache)
    assert (short[0] - long[0]).abs().max() > 1e-4


def test_errors(tmp_path, with_lora, capsys):
    with pytest.raises(CheckpointError, match="needs a checkpoint of family nld"):
        load_nld(write_orthrus(tmp_path / "orthrus"))
    with pytest.raises(ValueError, match="accept_rule"):
        LinearSelfSpecDrafter(with_lora, accept_rule="greedy")
    with pytest.raises(ValueError, match="at most 31 drafts per step"):
        speculative_generate(with_lora.lm, LinearSelfSpecDrafter(with_lora),
                             [Request([20, 21], 4)], 32)
    path = write_nld(tmp_path / "nld", block_size=4)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(path), "--method", "linear_self_spec", "--prompt",
              "the a", "--num-draft-tokens", "4"])
    assert exit_info.value.code == 2
    assert "drafts at most 3 tokens" in capsys.readouterr().err


def test_cli_generates_with_linear_self_spec(nld_path, capsys):
    assert main(["generate", "--model", str(nld_path), "--method", "linear_self_spec",
                 "--prompt", "the a of", "--max-tokens", "5", "--temperature", "0.8",
                 "--seed", "3"]) == 0
    assert "[linear_self_spec] 5 tokens" in capsys.readouterr().err
