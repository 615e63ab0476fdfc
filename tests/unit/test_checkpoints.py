"""Tiny published-layout checkpoints (diffspec.testing.checkpoints) and engine-free
inspection (diffspec.core.checkpoint)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    max_block_tokens,
    require_method,
    resolve_checkpoint,
    validate_block_size,
)
from diffspec.testing.checkpoints import (
    LAYOUTS,
    tiny_checkpoint,
    write_nld,
    write_orthrus,
    write_qwen3,
)

# layout -> family, architecture, model_type, block_size, logits_shift, method, one real tensor name
EXPECTED: dict[str, tuple[str, str, str, int | None, bool, str | None, str]] = {
    "qwen3": (
        "qwen3",
        "Qwen3ForCausalLM",
        "qwen3",
        None,
        False,
        None,
        "model.layers.1.self_attn.q_norm.weight",
    ),
    "orthrus": (
        "orthrus",
        "OrthrusLM",
        "qwen3",
        32,
        True,
        "orthrus",
        "model.layers.1.self_attn.k_norm_diff.weight",
    ),
    "nld": (
        "nld",
        "NemotronLabsDiffusionModel",
        "nemotron_labs_diffusion",
        32,
        False,
        "linear_self_spec",
        "encoder.layers.1.self_attn.o_proj.weight",
    ),
    "llada": (
        "llada",
        "LLaDAModelLM",
        "llada",
        None,
        False,
        "fast_dllm",
        "model.transformer.blocks.1.attn_out.weight",
    ),
    "dream": (
        "dream",
        "DreamModel",
        "Dream",
        None,
        True,
        "fast_dllm",
        "model.layers.1.self_attn.q_proj.bias",
    ),
    "fast_dllm_v2": (
        "fast_dllm_v2",
        "Fast_dLLM_QwenForCausalLM",
        "Fast_dLLM_Qwen",
        32,
        True,
        "fast_dllm",
        "model.layers.1.self_attn.k_proj.bias",
    ),
    "refusion": (
        "refusion",
        "Qwen3ForCausalLM",
        "qwen3",
        None,
        False,
        "refusion",
        "lm_head.weight",
    ),
    "llama": (
        None,
        "LlamaForCausalLM",
        "llama",
        None,
        False,
        None,
        "model.layers.1.self_attn.q_proj.weight",
    ),
    "llama_orthrus": (
        "orthrus",
        "OrthrusLlamaForCausalLM",
        "llama",
        32,
        True,
        "orthrus",
        "model.layers.1.self_attn.o_proj_diff.weight",
    ),
}
# A Llama vocabulary has no spare row: the mask is an existing token, not the tokenizer's
# mask_token.
EXISTING_TOKEN_MASKS = {"llama_orthrus": "<reponame>"}
MASK_TOKENS = {
    "orthrus": "<|mask|>",
    "nld": "[MASK]",
    "llada": "<|mdm_mask|>",
    "dream": "<|mask|>",
    "fast_dllm_v2": "|<MASK>|",
    "refusion": "<|mask|>",
}


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_checkpoints")


def _ckpt(root: Path, layout: str) -> Path:
    return tiny_checkpoint(layout, root)


def _variant(src: Path, dst: Path, **edits: Any) -> Path:
    """Copy a checkpoint and edit its config.json (a value of None deletes the key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in edits.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ---------------------------------------------------------------------------- every layout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_writes_and_is_identified(ckpt_root: Path, layout: str) -> None:
    from transformers import AutoTokenizer

    family, arch, model_type, block, shifted, method, tensor = EXPECTED[layout]
    path = _ckpt(ckpt_root, layout)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert config["model_type"] == model_type

    info = inspect_checkpoint(path)
    assert info.family == family
    assert info.architecture == arch
    assert info.block_size == block
    assert info.logits_shift is shifted
    assert info.num_layers == 2 and info.vocab_size == 256
    assert tensor in info.weight_names
    assert info.eos_token_ids and all(0 <= e < 256 for e in info.eos_token_ids)

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token_id == info.eos_token_ids[0]
    if layout in MASK_TOKENS:
        assert tokenizer.convert_tokens_to_ids(MASK_TOKENS[layout]) == info.mask_token_id
        assert tokenizer.mask_token == MASK_TOKENS[layout]
    elif layout in EXISTING_TOKEN_MASKS:
        assert tokenizer.convert_tokens_to_ids(EXISTING_TOKEN_MASKS[layout]) == info.mask_token_id
        assert tokenizer.mask_token is None
    else:
        assert info.mask_token_id is None
    assert tokenizer.decode(tokenizer.encode("the water is good")) == "the water is good"
    if method is not None:
        require_method(info, method)


def test_qwen_family_tokenizers_share_word_ids(ckpt_root: Path) -> None:
    from transformers import AutoTokenizer

    text = "what is the number of words"
    ids = {
        layout: AutoTokenizer.from_pretrained(_ckpt(ckpt_root, layout)).encode(text)
        for layout in ("qwen3", "orthrus", "refusion", "dream", "fast_dllm_v2")
    }
    assert len({tuple(v) for v in ids.values()}) == 1


@pytest.mark.parametrize("layout", ["qwen3", "refusion"])
def test_stock_layouts_load_with_transformers(ckpt_root: Path, layout: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = _ckpt(ckpt_root, layout)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.rope_parameters["rope_theta"] == 1000000.0
    files = _tensors(path)
    state = model.state_dict()
    assert set(files) == set(state)
    assert all(torch.equal(files[k], state[k]) for k in files)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 20, 30, 40]])).logits
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()


def test_orthrus_ar_weights_are_the_base_qwen3_bit_for_bit(ckpt_root: Path) -> None:
    import torch

    base = _tensors(_ckpt(ckpt_root, "qwen3"))
    orthrus = _tensors(_ckpt(ckpt_root, "orthrus"))
    ar = {k: v for k, v in orthrus.items() if "_diff." not in k}
    assert set(ar) == set(base)
    assert all(torch.equal(ar[k], base[k]) for k in base)
    diff = {k for k in orthrus if "_diff." in k}
    assert len(diff) == 6 * 2
    q_ar = orthrus["model.layers.0.self_attn.q_proj.weight"]
    q_diff = orthrus["model.layers.0.self_attn.q_proj_diff.weight"]
    assert not torch.equal(q_ar, q_diff) and torch.allclose(q_ar, q_diff, atol=1e-2)


def test_writers_are_seeded_and_deterministic(tmp_path: Path) -> None:
    a, b, c = (write_qwen3(tmp_path / n, seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_dtype_option_writes_bfloat16(tmp_path: Path) -> None:
    import torch

    path = write_qwen3(tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _tensors(path).values())


@pytest.mark.parametrize(
    ("kwargs", "model_type", "arch"),
    [
        ({"model_type": "orthrus"}, "orthrus", "OrthrusLM"),
        ({"architecture": "OrthrusForCausalLM"}, "qwen3", "OrthrusForCausalLM"),
    ],
)
def test_orthrus_config_variants_are_identified(
    tmp_path: Path, kwargs: dict, model_type: str, arch: str
) -> None:
    info = inspect_checkpoint(write_orthrus(tmp_path / "o", **kwargs))
    assert (info.family, info.model_type, info.architecture) == ("orthrus", model_type, arch)
    require_method(info, "orthrus")


def test_orthrus_detected_by_diff_weights_even_under_qwen3_architecture(
    ckpt_root: Path, tmp_path: Path
) -> None:
    path = _variant(_ckpt(ckpt_root, "orthrus"), tmp_path / "o", architectures=["Qwen3ForCausalLM"])
    assert inspect_checkpoint(path).family == "orthrus"


# ---------------------------------------------------------------------------- eos / lora / index


@pytest.mark.parametrize("eos_as_list", [False, True])
def test_eos_token_id_int_or_list_is_normalised(tmp_path: Path, eos_as_list: bool) -> None:
    path = write_orthrus(tmp_path / "o", eos_as_list=eos_as_list)
    raw = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert isinstance(raw, list) is eos_as_list
    assert inspect_checkpoint(path).eos_token_ids == (2, 0)
    (path / "generation_config.json").unlink()
    assert inspect_checkpoint(path).eos_token_ids == ((2, 0) if eos_as_list else (2,))


def test_nld_lora_is_found_in_peft_format(ckpt_root: Path) -> None:
    from peft import PeftConfig

    info = inspect_checkpoint(_ckpt(ckpt_root, "nld"))
    assert info.lora_path == info.path / "linear_spec_lora"
    config = PeftConfig.from_pretrained(str(info.lora_path))
    assert config.peft_type == "LORA" and set(config.target_modules) == {"o_proj"}
    names = set(json.loads(_header(info.lora_path / "adapter_model.safetensors")))
    assert "base_model.model.encoder.layers.0.self_attn.o_proj.lora_A.weight" in names
    assert "base_model.model.encoder.layers.1.self_attn.o_proj.lora_B.weight" in names


def _header(file: Path) -> str:
    raw = file.read_bytes()
    return raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()


def test_nld_without_lora_still_serves_linear_self_spec(tmp_path: Path) -> None:
    info = inspect_checkpoint(write_nld(tmp_path / "n", with_lora=False))
    assert info.lora_path is None
    require_method(info, "linear_self_spec")
    require_method(info, "tidar")


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_weights", "adapter_model.safetensors"),
        ("bad_type", "peft_type"),
        ("no_targets", "target_modules"),
    ],
)
def test_malformed_nld_lora_is_rejected(
    ckpt_root: Path, tmp_path: Path, breakage: str, message: str
) -> None:
    path = _variant(_ckpt(ckpt_root, "nld"), tmp_path / "n")
    lora = path / "linear_spec_lora"
    adapter = json.loads((lora / "adapter_config.json").read_text())
    if breakage == "no_weights":
        (lora / "adapter_model.safetensors").unlink()
    elif breakage == "bad_type":
        adapter["peft_type"] = "IA3"
    else:
        adapter["target_modules"] = []
    (lora / "adapter_config.json").write_text(json.dumps(adapter))
    with pytest.raises(CheckpointError, match=message):
        require_method(inspect_checkpoint(path), "linear_self_spec")


def test_nld_dream_style_logits_are_shifted(ckpt_root: Path, tmp_path: Path) -> None:
    path = _variant(_ckpt(ckpt_root, "nld"), tmp_path / "n", dlm_type="dream")
    assert inspect_checkpoint(path).logits_shift is True


def test_sharded_index_is_read_for_weight_names(ckpt_root: Path, tmp_path: Path) -> None:
    src = _ckpt(ckpt_root, "orthrus")
    names = inspect_checkpoint(src).weight_names
    path = _variant(src, tmp_path / "o")
    shard = path / "model-00001-of-00001.safetensors"
    (path / "model.safetensors").rename(shard)
    index = {"metadata": {}, "weight_map": {n: shard.name for n in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert inspect_checkpoint(path).weight_names == names


def test_fast_dllm_v2_mask_comes_from_the_tokenizer(ckpt_root: Path) -> None:
    path = _ckpt(ckpt_root, "fast_dllm_v2")
    assert "mask_token_id" not in json.loads((path / "config.json").read_text())
    assert inspect_checkpoint(path).mask_token_id == 5


# ---------------------------------------------------------------------------- negative cases


def test_base_qwen3_is_not_an_orthrus_checkpoint(ckpt_root: Path) -> None:
    info = inspect_checkpoint(_ckpt(ckpt_root, "qwen3"))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj_diff\.weight.*base Qwen3"
    ):
        require_method(info, "orthrus")


def test_partial_orthrus_weights_are_reported(ckpt_root: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = _variant(_ckpt(ckpt_root, "orthrus"), tmp_path / "o")
    tensors = _tensors(path)
    del tensors["model.layers.1.self_attn.k_norm_diff.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"lacks 1 .*model\.layers\.1\.self_attn\.k_norm_diff\.weight"
    ):
        require_method(inspect_checkpoint(path), "orthrus")


@pytest.mark.parametrize(
    ("layout", "method", "edits", "message"),
    [
        ("orthrus", "orthrus", {"mask_token_id": None}, "no mask_token_id in config.json"),
        (
            "orthrus",
            "orthrus",
            {"mask_token_id": 999},
            r"mask_token_id=999, outside its vocabulary \[0, 256\)",
        ),
        ("orthrus", "orthrus", {"block_size": None}, "no block_size"),
        ("nld", "linear_self_spec", {"mask_token_id": None}, "no mask_token_id"),
        ("nld", "tidar", {"block_size": None}, "no block_size"),
        ("fast_dllm_v2", "fast_dllm", {"bd_size": None}, "no bd_size"),
        ("llada", "fast_dllm", {"mask_token_id": -1}, "outside its vocabulary"),
        ("refusion", "refusion", {"mask_token_id": None}, "Qwen3 checkpoint with no mask_token_id"),
    ],
)
def test_missing_or_bad_config_is_named(
    ckpt_root: Path, tmp_path: Path, layout: str, method: str, edits: dict, message: str
) -> None:
    path = _variant(_ckpt(ckpt_root, layout), tmp_path / layout, **edits)
    with pytest.raises(CheckpointError, match=message):
        require_method(inspect_checkpoint(path), method)


def test_fast_dllm_v2_without_tokenizer_mask_is_rejected(ckpt_root: Path, tmp_path: Path) -> None:
    path = _variant(_ckpt(ckpt_root, "fast_dllm_v2"), tmp_path / "f")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(CheckpointError, match=r"nor the tokenizer \(\|<MASK>\|\)"):
        require_method(inspect_checkpoint(path), "fast_dllm")


@pytest.mark.parametrize(
    ("layout", "method", "message"),
    [
        ("llada", "orthrus", "needs a checkpoint of family orthrus;.* is family 'llada'"),
        ("dream", "linear_self_spec", "is family 'dream'"),
        ("orthrus", "fast_dllm", "family llada or dream or fast_dllm_v2 or nld;"),
        ("orthrus", "refusion", "'OrthrusLM'"),
    ],
)
def test_wrong_architecture_for_method(
    ckpt_root: Path, layout: str, method: str, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        require_method(inspect_checkpoint(_ckpt(ckpt_root, layout)), method)


def test_unknown_method(ckpt_root: Path) -> None:
    with pytest.raises(CheckpointError, match="unknown method 'medusa'"):
        require_method(inspect_checkpoint(_ckpt(ckpt_root, "qwen3")), "medusa")


@pytest.mark.parametrize(
    ("layout", "ok", "too_big"),
    [("orthrus", 31, 32), ("nld", 31, 32), ("fast_dllm_v2", 32, 33)],
)
def test_block_size_too_large(ckpt_root: Path, layout: str, ok: int, too_big: int) -> None:
    info = inspect_checkpoint(_ckpt(ckpt_root, layout))
    assert max_block_tokens(info) == ok
    validate_block_size(info, ok)
    with pytest.raises(CheckpointError, match=f"{too_big}"):
        validate_block_size(info, too_big)


def test_block_size_unbounded_and_nonpositive(ckpt_root: Path) -> None:
    info = inspect_checkpoint(_ckpt(ckpt_root, "llada"))
    assert max_block_tokens(info) is None
    validate_block_size(info, 256)
    with pytest.raises(CheckpointError, match=">= 1"):
        validate_block_size(info, 0)


# ---------------------------------------------------------------------------- resolution


def test_unknown_hub_id_offline_asks_to_download_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        CheckpointError, match=r"download it first.*hf download diffspec-tests/no-such-model"
    ):
        resolve_checkpoint("diffspec-tests/no-such-model", cache_dir=tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_checkpoint(tmp_path / "missing" / "folder")


def test_hub_id_resolves_from_the_local_cache(ckpt_root: Path, tmp_path: Path) -> None:
    commit = "0" * 40
    repo = tmp_path / "models--chiennv--Orthrus-Qwen3-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(_ckpt(ckpt_root, "orthrus"), repo / "snapshots" / commit)
    path = resolve_checkpoint("chiennv/Orthrus-Qwen3-8B", cache_dir=tmp_path)
    assert path == repo / "snapshots" / commit
    assert inspect_checkpoint(path).family == "orthrus"


def test_checkpoint_module_imports_without_torch() -> None:
    code = (
        "import sys, diffspec.core.checkpoint; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nld_weights_and_lora_load_into_the_real_module_tree(ckpt_root: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import Ministral3Config, Ministral3Model

    path = _ckpt(ckpt_root, "nld")
    config = json.loads((path / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keys += ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_parameters")
    model = torch.nn.Module()
    model.encoder = Ministral3Model(Ministral3Config(**{k: config[k] for k in keys}))
    model.diffusion_head = torch.nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
    model.load_state_dict(_tensors(path), strict=True)
    o_proj = model.encoder.layers[0].self_attn.o_proj
    x = torch.randn(3, config["num_attention_heads"] * config["head_dim"])
    base = o_proj(x)
    peft_model = PeftModel.from_pretrained(model, str(path / "linear_spec_lora"))
    with torch.no_grad():
        adapted = peft_model.base_model.model.encoder.layers[0].self_attn.o_proj(x)
    assert not torch.allclose(base, adapted)


def test_tidar_checkpoint_is_its_own_family() -> None:
    """A causal Qwen3 whose config names block_size and mask_token_id is a TiDAR-recipe
    checkpoint (not ReFusion); dlm_type "dream" means shifted drafts, K per step."""
    from diffspec.assets import SYNTH_REFUSION_DIR, SYNTH_TIDAR_DIR

    info = inspect_checkpoint(SYNTH_TIDAR_DIR)
    assert info.family == "tidar" and info.logits_shift is True
    require_method(info, "tidar")
    require_method(info, "tidar")
    assert max_block_tokens(info) == info.block_size
    with pytest.raises(CheckpointError, match="block_size"):
        validate_block_size(info, info.block_size + 1)
    with pytest.raises(CheckpointError, match="family"):
        require_method(info, "refusion")
    assert inspect_checkpoint(SYNTH_REFUSION_DIR).family == "refusion"


@pytest.mark.parametrize("layout", ["orthrus", "nld", "refusion"])
def test_reference_loaders_refuse_a_checkpoint_missing_a_tensor(layout: str, tmp_path: Path) -> None:
    """transformers would random-initialise a missing tensor; the oracle's loaders refuse."""
    from safetensors.torch import load_file, save_file

    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.model_executors.reference.refusion import load_refusion

    path = LAYOUTS[layout](tmp_path / layout)
    tensors = load_file(str(path / "model.safetensors"))
    dropped = next(k for k in tensors if "layers.1.mlp.down_proj" in k)
    del tensors[dropped]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    loader = {"orthrus": load_orthrus, "nld": load_nld, "refusion": load_refusion}[layout]
    with pytest.raises(CheckpointError, match="lacks 1 tensor"):
        loader(path)


def test_add_eos_token_puts_it_first_and_keeps_the_others(tmp_path) -> None:
    import json

    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.testing.checkpoints import add_eos_token, write_qwen3

    path = write_qwen3(tmp_path / "qwen3")
    before = inspect_checkpoint(path).eos_token_ids
    add_eos_token(path, 77)
    config = json.loads((path / "generation_config.json").read_text())
    assert config["eos_token_id"][0] == 77
    assert set(inspect_checkpoint(path).eos_token_ids) == {77, *before}


def test_engine_orthrus_models_name_the_first_missing_diffusion_weight() -> None:
    """The error both engines' Orthrus models raise after loading a checkpoint without
    diffusion weights (one message, diffspec.core.checkpoint.orthrus_weights_missing)."""
    from diffspec.core.checkpoint import orthrus_weights_missing

    qwen3 = orthrus_weights_missing(["model.layers.0.self_attn.k_norm_diff.weight",
                                     "model.layers.1.self_attn.q_proj_diff.weight"],
                                    "tensors", norms=True)
    assert str(qwen3) == (
        "the checkpoint has no Orthrus diffusion weights for "
        "model.layers.0.self_attn.k_norm_diff.weight (2 tensors missing); expected "
        "model.layers.N.self_attn.{q,k,v,o}_proj_diff and {q,k}_norm_diff for every layer")
    llama = orthrus_weights_missing(["model.layers.0.self_attn.o_proj_diff.weight"],
                                    "parameters", norms=False)
    assert "(1 parameters missing)" in str(llama)
    assert str(llama).endswith("self_attn.{q,k,v,o}_proj_diff for every layer")
