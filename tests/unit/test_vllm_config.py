"""The vLLM plugin's pure parts, without vLLM: the speculative-config translation (one
place that validates a self-speculative config against the checkpoint) and the rule that
plans each request's draft block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffspec.core.checkpoint import CheckpointError
from diffspec.plugin.vllm.config import (
    is_self_spec_proposer,
    proposer_path,
    translate_speculative_config,
)
from diffspec.testing.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.unit

ORTHRUS_PROPOSER = proposer_path("orthrus")
NLD_PROPOSER = proposer_path("linear_self_spec")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: tiny_checkpoint(name, root) for name in ("orthrus", "nld", "qwen3")}


# ------------------------------------------------------------------ accepted configs


def test_orthrus_becomes_custom_class(ckpts) -> None:
    out = translate_speculative_config({"method": "orthrus", "num_speculative_tokens": 31},
                                       ckpts["orthrus"])
    assert out == {"method": "custom_class", "model": ORTHRUS_PROPOSER,
                   "num_speculative_tokens": 31}


def test_linear_self_spec_becomes_custom_class(ckpts) -> None:
    out = translate_speculative_config(
        {"method": "linear_self_spec", "num_speculative_tokens": 8, "enforce_eager": True},
        ckpts["nld"])
    assert out == {"method": "custom_class", "model": NLD_PROPOSER,
                   "num_speculative_tokens": 8, "enforce_eager": True}


def test_num_speculative_tokens_defaults_to_block_size_minus_one(ckpts) -> None:
    out = translate_speculative_config({"method": "orthrus"}, ckpts["orthrus"])
    assert out["num_speculative_tokens"] == 31


def test_model_may_name_the_served_checkpoint(ckpts) -> None:
    spec = {"method": "orthrus", "num_speculative_tokens": 4, "model": str(ckpts["orthrus"])}
    assert translate_speculative_config(spec, str(ckpts["orthrus"]))["model"] == ORTHRUS_PROPOSER


def test_config_only_check_for_a_hub_id_not_in_the_cache(ckpts) -> None:
    hf_config = json.loads((ckpts["orthrus"] / "config.json").read_text())
    out = translate_speculative_config({"method": "orthrus", "num_speculative_tokens": 31},
                                       "nobody-here/not-cached-orthrus", hf_config)
    assert out["model"] == ORTHRUS_PROPOSER
    with pytest.raises(CheckpointError, match="at most 31"):
        translate_speculative_config({"method": "orthrus", "num_speculative_tokens": 32},
                                     "nobody-here/not-cached-orthrus", hf_config)


def test_is_self_spec_proposer() -> None:
    class Spec:
        method, model = "custom_class", ORTHRUS_PROPOSER

    class Other:
        method, model = "custom_class", "my.pkg.Proposer"

    assert is_self_spec_proposer(Spec())
    assert not is_self_spec_proposer(Other())
    assert not is_self_spec_proposer(None)


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize(
    ("name", "ckpt", "spec", "match"),
    [
        ("too_many_drafts", "orthrus", {"method": "orthrus", "num_speculative_tokens": 32},
         r"block_size=32.*at most 31 tokens per step.*32 requested"),
        ("no_diffusion_weights", "qwen3", {"method": "orthrus", "num_speculative_tokens": 4},
         r"no diffusion weights.*q_proj_diff"),
        ("orthrus_on_nld", "nld", {"method": "orthrus", "num_speculative_tokens": 4},
         r"family orthrus.*'nld'"),
        ("nld_on_orthrus", "orthrus", {"method": "linear_self_spec", "num_speculative_tokens": 4},
         r"family nld.*'orthrus'"),
        ("unknown_method", "orthrus", {"method": "orthrus2", "num_speculative_tokens": 4},
         r"unknown diffspec speculative method 'orthrus2'"),
        ("unknown_option", "orthrus",
         {"method": "orthrus", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
         r"'prompt_lookup_max' does not apply to method 'orthrus'"),
        ("probabilistic_drafts", "orthrus",
         {"method": "orthrus", "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"},
         r"cannot honour draft_sample_method='probabilistic'"),
        ("separate_draft_model", "orthrus",
         {"method": "orthrus", "num_speculative_tokens": 4, "model": "some/other-model"},
         r"takes no separate draft model"),
        ("zero_drafts", "orthrus", {"method": "orthrus", "num_speculative_tokens": 0},
         r"must be an int >= 1"),
    ],
)
def test_errors(ckpts, name: str, ckpt: str, spec: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        translate_speculative_config(spec, ckpts[ckpt])


@pytest.mark.parametrize(
    ("ckpt", "spec", "first"),
    [
        ("orthrus", {"method": "orthrus", "num_speculative_tokens": 32},
         "set num_speculative_tokens to at most 31 (or leave it out"),
        ("orthrus", {"method": "orthrus", "num_speculative_tokens": 0},
         "set num_speculative_tokens to an int >= 1 and <= 31"),
        ("orthrus", {"method": "orthrus2"},
         'use "method": "orthrus" or another of: linear_self_spec, orthrus, tidar ('),
        ("orthrus", {"method": "foo"}, "use one of: linear_self_spec, orthrus, tidar ("),
        ("qwen3", {"method": "orthrus", "num_speculative_tokens": 4},
         "serve a checkpoint of family orthrus with method 'orthrus': "),
        ("nld", {"method": "orthrus", "num_speculative_tokens": 4},
         ("serve a checkpoint of family orthrus with method 'orthrus', or use method "
          "'linear_self_spec' or 'tidar', which serve this nld checkpoint: ")),
        ("orthrus", {"method": "linear_self_spec", "num_speculative_tokens": 4},
         ("serve a checkpoint of family nld with method 'linear_self_spec', or use method "
          "'orthrus', which serves this orthrus checkpoint: ")),
        ("orthrus", {"method": "orthrus", "prompt_lookup_max": 3},
         "remove 'prompt_lookup_max' from the speculative_config"),
        ("orthrus", {"method": "orthrus", "draft_sample_method": "probabilistic"},
         "set draft_sample_method to 'greedy', or leave it out"),
        ("orthrus", {"method": "orthrus", "model": "some/other-model"},
         'remove "model" from the speculative_config'),
    ],
    ids=["too_many_drafts", "zero_drafts", "misspelt_method", "unknown_method",
         "no_diffusion_weights", "wrong_family", "wrong_family_other_way", "unknown_option",
         "probabilistic_drafts", "separate_draft_model"],
)
def test_errors_say_what_to_do_first(ckpts, ckpt: str, spec: dict, first: str) -> None:
    """The first words of each configuration error are the fix (then the reason)."""
    with pytest.raises(CheckpointError) as info:
        translate_speculative_config(spec, ckpts[ckpt])
    message = str(info.value)
    assert message.startswith(first), message
    assert "\n" not in message


def test_unknown_method_with_vllm_methods_names_both() -> None:
    from diffspec.plugin.vllm.config import unknown_method_message

    vllm = ["eagle", "eagle3", "ngram", "medusa"]
    assert unknown_method_message("egale3", vllm) == (
        'use "method": "eagle3" or another of: linear_self_spec, orthrus, tidar (diffspec), '
        "eagle, eagle3, medusa, ngram (vLLM) (unknown speculative method 'egale3')")
    assert unknown_method_message(None, vllm).startswith("use one of: linear_self_spec, ")


def test_wrong_architecture_is_refused(tmp_path: Path, ckpts) -> None:
    """A Qwen3ForCausalLM config with *_diff weights would load as stock Qwen3 in vLLM (no
    diffusion view): refused up front."""
    import shutil

    folder = tmp_path / "orthrus-as-qwen3"
    shutil.copytree(ckpts["orthrus"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"^serve a checkpoint whose config.json names "
                       r"one of the architectures OrthrusLM.*architecture 'Qwen3ForCausalLM'"):
        translate_speculative_config({"method": "orthrus", "num_speculative_tokens": 4}, folder)


# ------------------------------------------------------------------ draft block planning


def test_plan_blocks() -> None:
    from diffspec.spec_workers.vllm.two_pass import DraftBlock, plan_blocks

    blocks = plan_blocks(
        sampled_token_ids=[[5, 6], [], [7], [8], [9]],
        num_committed=[10, 4, 20, 100, 30],
        num_left=[50, 40, 3, None, 1],
        num_slots=[64, 32, 64, 128, 64],
        num_speculative_tokens=31,
        max_model_len=120,
    )
    assert blocks == [
        DraftBlock(row=0, anchor=6, start=9, num_drafts=31),  # full block
        # row 1: partial prefill, nothing sampled -> no block
        DraftBlock(row=2, anchor=7, start=19, num_drafts=2),  # 3 tokens left: anchor's + 2
        DraftBlock(row=3, anchor=8, start=99, num_drafts=20),  # max_model_len - committed
        # row 4: one token left -> it comes from the verify pass alone, no draft
    ]
    # never past the request's KV slots (the scheduler's lookahead normally covers the block)
    (short,) = plan_blocks([[5]], [10], [None], [32], 31, 512)
    assert short == DraftBlock(row=0, anchor=5, start=9, num_drafts=22)


def test_plan_v2_blocks() -> None:
    """The V2 runner's speculator: same block rule as V1 (model length, slots held), no
    max_tokens cut (the runner verifies its fixed count; the scheduler drops the excess)."""
    from diffspec.spec_workers.vllm.two_pass import DraftBlock, plan_v2_blocks

    blocks = plan_v2_blocks(num_sampled=[2, 0, 1, 1, 1], anchor_positions=[9, 3, 19, 99, 60],
                            num_slots=[64, 32, 64, 128, 64], num_drafts=31, max_model_len=120)
    assert blocks == [
        DraftBlock(row=0, anchor=-1, start=9, num_drafts=31),
        # row 1: a prefill chunk (nothing sampled): no block
        DraftBlock(row=2, anchor=-1, start=19, num_drafts=31),  # max_tokens is not its rule
        DraftBlock(row=3, anchor=-1, start=99, num_drafts=20),  # max_model_len - 1 - p
        DraftBlock(row=4, anchor=-1, start=60, num_drafts=3),  # slots 61 .. 63 held
    ]
    assert plan_v2_blocks([1], [63], [64], 7, 512) == []  # no slot past the anchor


# ------------------------------------------------------------------ model types


def test_remote_code_model_types_load_without_remote_code(tmp_path: Path) -> None:
    """``model_type: "orthrus"`` and ``"nemotron_labs_diffusion"`` configs load through
    transformers' AutoConfig once register() has registered them (as vLLM loads them)."""
    from transformers import AutoConfig

    from diffspec.methods import FAMILIES
    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.testing.checkpoints import write_nld, write_orthrus

    model_types = {t: c for f in FAMILIES.values() for t, c in f.hf_configs.items()}
    assert set(model_types) == {"orthrus", "nemotron_labs_diffusion", "llada", "Dream",
                                "Fast_dLLM_Qwen"}
    register_model_types(model_types)
    register_model_types(model_types)  # idempotent
    orthrus = AutoConfig.from_pretrained(write_orthrus(tmp_path / "o", model_type="orthrus"))
    assert (orthrus.model_type, orthrus.block_size, orthrus.head_dim) == ("orthrus", 32, 32)
    nld = AutoConfig.from_pretrained(write_nld(tmp_path / "n", with_lora=False))
    assert nld.model_type == "nemotron_labs_diffusion"
    assert nld.rope_parameters["llama_4_scaling_beta"] == 0.1 and nld.mask_token_id is not None
