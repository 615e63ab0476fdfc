"""Tiny random-weight checkpoints in the published layouts, written offline.

Design notes: docs/design/testing.md (section ``diffspec/testing/checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from diffspec.testing.tokenizer import CHAT_TEMPLATE, build_word_tokenizer, save_tokenizer

__all__ = [
    "LAYOUTS",
    "ORTHRUS_DIFF_NOISE",
    "add_eos_token",
    "default_words",
    "tiny_checkpoint",
    "write_dream",
    "write_fast_dllm_v2",
    "write_llada",
    "write_llama",
    "write_llama_orthrus",
    "write_nld",
    "write_orthrus",
    "write_qwen3",
    "write_refusion",
]

# Sizes shared by every layout: 2 layers, head_dim 32 (vLLM's CPU attention needs >= 32).
TINY_SIZES: dict[str, int] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 4096,
}
# Orthrus *_diff weights start as the AR weights plus N(0, ORTHRUS_DIFF_NOISE^2) noise
# (the real recipe initialises them from the AR projections, then trains them).
ORTHRUS_DIFF_NOISE = 1e-3
_COMPLETE = ".diffspec-complete"

_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
_QWEN_SLOTS = 4  # ids 5..8, see the module docstring
# SmolLM2's first special tokens (ids 0..7); its vocabulary has no mask token and no spare
# row, so a Llama Orthrus names an existing token (here <reponame>, id 4) as the mask.
_SMOLLM_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
    "<file_sep>", "<filename>", "<gh_stars>",
)  # fmt: skip
LLAMA_ORTHRUS_MASK_TOKEN_ID = 4
_LLADA_SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
)
_NLD_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[MASK]",
)  # fmt: skip
_LLADA_TEMPLATE = (
    "<|startoftext|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_NLD_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST]{{ message['content'] }}"
    "[/INST]{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)
_WORD_TEXT = (
    "user assistant system the a an of to and in is it that for on with as was at by this be "
    "are from or have not but what all were when we there can one which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number great "
    ". , ? ! : ; ( ) + - * / = 0 1 2 3 4 5 6 7 8 9"
)
_BASE_WORDS = tuple(_WORD_TEXT.split())


def default_words(n: int = 200) -> list[str]:
    """A fixed list of ``n`` distinct words: common English words, then ``tokN`` fillers."""
    words = list(dict.fromkeys(_BASE_WORDS))[:n]
    return words + [f"tok{i}" for i in range(n - len(words))]


# ---------------------------------------------------------------------------- writers


def write_qwen3(path: str | Path, *, seed: int = 0, dtype: str = "float32",
                eos_as_list: bool = False, words: Sequence[str] | None = None,
                **overrides: Any) -> Path:
    """Stock ``Qwen3ForCausalLM`` (the Orthrus / ReFusion base), untied LM head like Qwen3-8B."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_qwen_tokenizer(path, {}, sizes["vocab_size"], words)
    config = _qwen3_config(sizes, ids, dtype, eos_as_list)
    tensors = _qwen3_tensors(sizes, seed, tie=_tie(config, overrides))
    return _finish(path, config, tensors, dtype, overrides, _qwen3_generation_config(ids))


def write_orthrus(path: str | Path, *, model_type: str = "qwen3", architecture: str = "OrthrusLM",
                  eos_as_list: bool = False, block_size: int = 32,
                  diff_noise: float = ORTHRUS_DIFF_NOISE, seed: int = 0, dtype: str = "float32",
                  words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """Orthrus (``chiennv/Orthrus-Qwen3-*``): the base Qwen3 plus ``q/k/v/o_proj_diff`` and
    ``q/k_norm_diff`` per layer.

    The AR tensors are bit-identical to :func:`write_qwen3` with the same ``seed`` and
    sizes; each ``*_diff`` tensor is its AR counterpart plus N(0, ``diff_noise``^2) noise
    drawn from ``seed + 1``.
    """
    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_qwen_tokenizer(path, {7: "<|mask|>"}, sizes["vocab_size"], words, mask="<|mask|>")
    config = _qwen3_config(sizes, ids, dtype, eos_as_list)
    config.update(
        architectures=[architecture],
        model_type=model_type,
        # auto_map: the real repos need trust_remote_code; the module name is not confirmed.
        auto_map={"AutoModelForCausalLM": "modeling_orthrus.OrthrusLM"},
        block_size=block_size,
        mask_token_id=ids["<|mask|>"],
    )
    tensors = _qwen3_tensors(sizes, seed, tie=_tie(config, overrides))
    _add_diff_tensors(tensors, sizes["num_hidden_layers"],
                      ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"), seed,
                      diff_noise)
    return _finish(path, config, tensors, dtype, overrides, _qwen3_generation_config(ids))


def write_refusion(path: str | Path, *, seed: int = 0, dtype: str = "float32",
                   words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """ReFusion (``GSAI-ML/ReFusion``): a stock causal Qwen3 whose tokenizer adds
    ``<|beginoftext|>`` and ``<|mask|>``, the latter named by ``config.mask_token_id``."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    specials = {7: "<|beginoftext|>", 8: "<|mask|>"}
    ids = _write_qwen_tokenizer(path, specials, sizes["vocab_size"], words, mask="<|mask|>")
    config = _qwen3_config(sizes, ids, dtype, eos_as_list=False)
    config["mask_token_id"] = ids["<|mask|>"]
    tensors = _qwen3_tensors(sizes, seed, tie=_tie(config, overrides))
    return _finish(path, config, tensors, dtype, overrides, _qwen3_generation_config(ids))


def write_nld(path: str | Path, *, with_lora: bool = True, lora_rank: int = 8, lora_alpha: int = 32,
              block_size: int = 32, seed: int = 0, dtype: str = "float32",
              words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """Nemotron-Labs-Diffusion (``nvidia/Nemotron-Labs-Diffusion-8B``): a Ministral3
    backbone under ``encoder.*`` and an untied ``diffusion_head.weight``.

    With ``with_lora`` it also writes ``linear_spec_lora/`` as PEFT does (adapter_config.json
    + adapter_model.safetensors, LoRA on ``o_proj``; the real one is r=128, alpha=512).
    """
    import torch
    from transformers import Ministral3Config, Ministral3Model

    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_tokenizer(
        path, _NLD_SPECIALS, sizes["vocab_size"], words,
        eos="</s>", bos="<s>", pad="<pad>", mask="[MASK]", chat_template=_NLD_TEMPLATE,
    )  # fmt: skip
    rope = {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 16.0,
        "llama_4_scaling_beta": 0.1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16384,
        "rope_theta": 1000000.0,
        "rope_type": "yarn",
    }
    config = {
        "ar_loss_weight": 1.0,
        "architectures": ["NemotronLabsDiffusionModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "sdpa",
        "auto_map": {
            "AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
            "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel",
        },
        "block_size": block_size,
        "bos_token_id": ids["<s>"],
        "dlm_loss_weight": None,
        "dlm_paradigm": "bidirectional",
        "dp_varying_mask_ratio": False,
        "eos_token_id": ids["</s>"],
        "head_dim": sizes["head_dim"],
        "hidden_act": "silu",
        "hidden_size": sizes["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": sizes["intermediate_size"],
        "mask_token_id": ids["[MASK]"],
        "max_position_embeddings": 262144,
        "mlp_bias": False,
        "model_type": "nemotron_labs_diffusion",
        "num_attention_heads": sizes["num_attention_heads"],
        "num_hidden_layers": sizes["num_hidden_layers"],
        "num_key_value_heads": sizes["num_key_value_heads"],
        "rms_norm_eps": 1e-05,
        "rope_parameters": rope,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "5.0.0",
        "use_cache": False,
        "vocab_size": sizes["vocab_size"],
    }
    backbone = Ministral3Config(
        **{k: sizes[k] for k in _MODEL_SIZE_KEYS},
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
    )
    with _seeded(seed):
        model = torch.nn.Module()
        model.encoder = Ministral3Model(backbone)
        model.diffusion_head = torch.nn.Linear(
            sizes["hidden_size"], sizes["vocab_size"], bias=False
        )
        model.diffusion_head.weight.data.normal_(0.0, 0.02)
    tensors = dict(model.state_dict())
    generation = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
    _finish(path, config, tensors, dtype, overrides, generation)
    if with_lora:
        _write_peft_lora(path / "linear_spec_lora", model, lora_rank, lora_alpha, seed + 1, dtype)
    return path


def write_llada(path: str | Path, *, seed: int = 0, dtype: str = "float32",
                words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """LLaDA (``GSAI-ML/LLaDA-8B-Instruct``): OLMo-style config (``d_model``, ``n_layers``)
    and ``model.transformer.{wte,blocks.N.*,ln_f,ff_out}`` tensors; mask ``<|mdm_mask|>``."""
    import torch

    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_tokenizer(
        path, _LLADA_SPECIALS, sizes["vocab_size"], words,
        eos="<|endoftext|>", bos="<|startoftext|>", pad="<|endoftext|>", mask="<|mdm_mask|>",
        chat_template=_LLADA_TEMPLATE,
    )  # fmt: skip
    d, heads, kv = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    head_dim, mlp, vocab = d // heads, sizes["intermediate_size"], sizes["vocab_size"]
    config = {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": d,
        "embedding_dropout": 0.0,
        "embedding_size": vocab,
        "eos_token_id": ids["<|endoftext|>"],
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": ids["<|mdm_mask|>"],
        "max_sequence_length": sizes["max_position_embeddings"],
        "mlp_hidden_size": mlp,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": heads,
        "n_kv_heads": kv,
        "n_layers": sizes["num_hidden_layers"],
        "pad_token_id": ids["<|endoftext|>"],
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": dtype,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": vocab,
        "weight_tying": False,
    }
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * 0.02

    tensors = {"model.transformer.wte.weight": normal(vocab, d)}
    for i in range(sizes["num_hidden_layers"]):
        block = f"model.transformer.blocks.{i}."
        tensors.update(
            {
                block + "attn_norm.weight": torch.ones(d),
                block + "q_proj.weight": normal(heads * head_dim, d),
                block + "k_proj.weight": normal(kv * head_dim, d),
                block + "v_proj.weight": normal(kv * head_dim, d),
                block + "attn_out.weight": normal(d, heads * head_dim),
                block + "ff_norm.weight": torch.ones(d),
                block + "ff_proj.weight": normal(mlp, d),
                block + "up_proj.weight": normal(mlp, d),
                block + "ff_out.weight": normal(d, mlp),
            }
        )
    tensors["model.transformer.ln_f.weight"] = torch.ones(d)
    tensors["model.transformer.ff_out.weight"] = normal(vocab, d)
    return _finish(path, config, tensors, dtype, overrides, generation=None)


def write_dream(path: str | Path, *, seed: int = 0, dtype: str = "float32",
                words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """Dream (``Dream-org/Dream-v0-Instruct-7B``): Qwen2.5 tensors (q/k/v biases) under
    ``architectures: ["DreamModel"]``, ``model_type: "Dream"``; mask ``<|mask|>``."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    specials = {5: "<|beginoftext|>", 6: "<|mask|>"}
    ids = _write_qwen_tokenizer(
        path, specials, sizes["vocab_size"], words, eos="<|endoftext|>", mask="<|mask|>"
    )
    config = {
        **_qwen_family_keys(sizes, dtype),
        "architectures": ["DreamModel"],
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": ids["<|beginoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "mask_token_id": ids["<|mask|>"],
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "Dream",
        "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": "4.46.2",
        "use_cache": False,
    }
    tensors = _qwen2_tensors(sizes, seed)
    generation = {
        "bos_token_id": ids["<|beginoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    return _finish(path, config, tensors, dtype, overrides, generation)


def write_fast_dllm_v2(path: str | Path, *, bd_size: int = 32, mask_in_config: bool = False,
                       seed: int = 0, dtype: str = "float32", words: Sequence[str] | None = None,
                       **overrides: Any) -> Path:
    """Fast-dLLM v2 (``Efficient-Large-Model/Fast_dLLM_v2_7B``): Qwen2.5 tensors,
    ``architectures: ["Fast_dLLM_QwenForCausalLM"]``, ``bd_size``. The real config has no
    ``mask_token_id``: the mask is the tokenizer's ``|<MASK>|`` (151665), which the
    reference code and SGLang hard-code; ``mask_in_config`` also writes it to config.json."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_qwen_tokenizer(path, {5: "|<MASK>|"}, sizes["vocab_size"], words, mask="|<MASK>|")
    config = {
        **_qwen_family_keys(sizes, dtype),
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModel": "modeling.Fast_dLLM_QwenModel",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        "bd_size": bd_size,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "layer_types": ["full_attention"] * sizes["num_hidden_layers"],
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "Fast_dLLM_Qwen",
        "use_cache": True,
    }
    if mask_in_config:
        config["mask_token_id"] = ids["|<MASK>|"]
    tensors = _qwen2_tensors(sizes, seed)
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }
    return _finish(path, config, tensors, dtype, overrides, generation)


def write_llama(path: str | Path, *, seed: int = 0, dtype: str = "float32",
                words: Sequence[str] | None = None, **overrides: Any) -> Path:
    """Stock ``LlamaForCausalLM`` with the config keys of SmolLM2-135M-Instruct (tied
    embeddings, no q/k norms, ``<|im_end|>`` as EOS, no mask token in the tokenizer)."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_tokenizer(path, _SMOLLM_SPECIALS, sizes["vocab_size"], words,
                           eos="<|im_end|>", bos="<|im_start|>", pad="<|im_end|>")
    config = _llama_config(sizes, ids, dtype)
    tensors = _llama_tensors(sizes, seed, tie=_tie(config, overrides))
    return _finish(path, config, tensors, dtype, overrides, _llama_generation_config(ids))


def write_llama_orthrus(path: str | Path, *, block_size: int = 32,
                        mask_token_id: int | None = LLAMA_ORTHRUS_MASK_TOKEN_ID,
                        diff_noise: float = ORTHRUS_DIFF_NOISE, seed: int = 0,
                        dtype: str = "float32", words: Sequence[str] | None = None,
                        **overrides: Any) -> Path:
    """A Llama Orthrus (``OrthrusLlamaForCausalLM``, ``model_type: "llama"``): the base of
    :func:`write_llama` (AR tensors bit-identical for the same ``seed`` and sizes) plus
    ``q/k/v/o_proj_diff`` per layer, each its AR counterpart plus N(0, ``diff_noise``^2)
    noise drawn from ``seed + 1``. The mask is an existing token (id 4 by default)."""
    path = _prepare(path)
    sizes = _sizes(overrides)
    ids = _write_tokenizer(path, _SMOLLM_SPECIALS, sizes["vocab_size"], words,
                           eos="<|im_end|>", bos="<|im_start|>", pad="<|im_end|>")
    config = _llama_config(sizes, ids, dtype)
    config.update(architectures=["OrthrusLlamaForCausalLM"], block_size=block_size,
                  mask_token_id=mask_token_id)
    tensors = _llama_tensors(sizes, seed, tie=_tie(config, overrides))
    _add_diff_tensors(tensors, sizes["num_hidden_layers"],
                      ("q_proj", "k_proj", "v_proj", "o_proj"), seed, diff_noise)
    return _finish(path, config, tensors, dtype, {"mask_token_id": mask_token_id, **overrides},
                   _llama_generation_config(ids))


LAYOUTS: dict[str, Callable[..., Path]] = {
    "qwen3": write_qwen3,
    "orthrus": write_orthrus,
    "nld": write_nld,
    "llada": write_llada,
    "dream": write_dream,
    "fast_dllm_v2": write_fast_dllm_v2,
    "refusion": write_refusion,
    "llama": write_llama,
    "llama_orthrus": write_llama_orthrus,
}


def add_eos_token(path: str | Path, token_id: int) -> None:
    """Make ``token_id`` the first EOS of the checkpoint at ``path`` (its
    ``generation_config.json``, which engines and the reference read), keeping the others:
    tests use it to make a greedy request stop inside a draft block."""
    config_file = Path(path) / "generation_config.json"
    config = json.loads(config_file.read_text())
    eos = config.get("eos_token_id")
    others = [] if eos is None else eos if isinstance(eos, list) else [eos]
    config["eos_token_id"] = [int(token_id), *others]
    config_file.write_text(json.dumps(config))


def tiny_checkpoint(layout: str, root: str | Path) -> Path:
    """``root/layout`` with the default tiny checkpoint of ``layout``, written on first use.

    A marker file makes later calls (this process or another sharing ``root``) reuse the
    folder; the write goes to a temporary sibling that is renamed into place.
    """
    if layout not in LAYOUTS:
        raise KeyError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    target = Path(root) / layout
    if (target / _COMPLETE).is_file():
        return target
    tmp = Path(root) / f".{layout}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    LAYOUTS[layout](tmp)
    (tmp / _COMPLETE).write_text("ok\n")
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / _COMPLETE).is_file():
            raise
    return target


# ---------------------------------------------------------------------------- helpers

_MODEL_SIZE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim",
)  # fmt: skip


def _prepare(path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sizes(overrides: dict[str, Any]) -> dict[str, int]:
    return {k: int(overrides.get(k, v)) for k, v in TINY_SIZES.items()}


def _tie(config: dict[str, Any], overrides: dict[str, Any]) -> bool:
    return bool(overrides.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch for module construction without disturbing the caller's RNG."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _write_tokenizer(
    path: Path,
    specials: Sequence[str],
    vocab_size: int,
    words: Sequence[str] | None,
    *,
    eos: str,
    bos: str | None = None,
    pad: str | None = None,
    mask: str | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> dict[str, int]:
    """Save a word-level tokenizer into ``path``; return special token -> id."""
    words = list(words) if words is not None else default_words(vocab_size - len(specials) - 1 - 16)
    tokenizer = build_word_tokenizer(words, specials)
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}"
        )
    save_tokenizer(tokenizer, path, eos_token=eos, bos_token=bos, pad_token=pad, mask_token=mask,
                   chat_template=chat_template)  # fmt: skip
    return {tok: i for i, tok in enumerate(specials)}


def _write_qwen_tokenizer(
    path: Path,
    slots: dict[int, str],
    vocab_size: int,
    words: Sequence[str] | None,
    *,
    eos: str = "<|im_end|>",
    mask: str | None = None,
) -> dict[str, int]:
    base = len(_QWEN_SPECIALS)
    specials = list(_QWEN_SPECIALS) + [
        slots.get(base + k, f"<|reserved_{k}|>") for k in range(_QWEN_SLOTS)
    ]
    return _write_tokenizer(
        path, specials, vocab_size, words, eos=eos, pad="<|endoftext|>", mask=mask
    )


def _qwen_family_keys(sizes: dict[str, int], dtype: str) -> dict[str, Any]:
    """The config.json keys and values the Qwen2 / Qwen2.5 / Qwen3 layouts share (Dream and
    Fast-dLLM v2 are Qwen2.5 underneath); each layout's function adds its own."""
    return {
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": sizes["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": sizes["intermediate_size"],
        "num_attention_heads": sizes["num_attention_heads"],
        "num_hidden_layers": sizes["num_hidden_layers"],
        "num_key_value_heads": sizes["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_sliding_window": False,
        "vocab_size": sizes["vocab_size"],
    }


def _qwen3_config(
    sizes: dict[str, int], ids: dict[str, int], dtype: str, eos_as_list: bool
) -> dict[str, Any]:
    """config.json with the keys of Qwen/Qwen3-8B (legacy ``rope_theta``/``rope_scaling``)."""
    eos = ids["<|im_end|>"]
    return {
        **_qwen_family_keys(sizes, dtype),
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [eos, ids["<|endoftext|>"]] if eos_as_list else eos,
        "head_dim": sizes["head_dim"],
        "max_position_embeddings": sizes["max_position_embeddings"],
        "max_window_layers": sizes["num_hidden_layers"],
        "model_type": "qwen3",
        "transformers_version": "4.51.0",
        "use_cache": True,
    }


def _llama_config(sizes: dict[str, int], ids: dict[str, int], dtype: str) -> dict[str, Any]:
    """config.json with the keys of HuggingFaceTB/SmolLM2-135M-Instruct."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|im_start|>"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": sizes["head_dim"],
        "hidden_act": "silu",
        "hidden_size": sizes["hidden_size"],
        "initializer_range": 0.041666666666666664,
        "intermediate_size": sizes["intermediate_size"],
        "max_position_embeddings": sizes["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": sizes["num_attention_heads"],
        "num_hidden_layers": sizes["num_hidden_layers"],
        "num_key_value_heads": sizes["num_key_value_heads"],
        "pad_token_id": ids["<|im_end|>"],
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "transformers_version": "4.42.3",
        "use_cache": True,
        "vocab_size": sizes["vocab_size"],
    }


def _llama_generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {"bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|im_end|>"]}


def _llama_tensors(sizes: dict[str, int], seed: int, *, tie: bool) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _causal_lm_tensors(LlamaForCausalLM, LlamaConfig(
        **{k: sizes[k] for k in _MODEL_SIZE_KEYS}, tie_word_embeddings=tie,
        initializer_range=0.2), seed)


def _qwen3_generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _qwen3_tensors(sizes: dict[str, int], seed: int, *, tie: bool) -> dict[str, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _causal_lm_tensors(Qwen3ForCausalLM, Qwen3Config(
        **{k: sizes[k] for k in _MODEL_SIZE_KEYS}, tie_word_embeddings=tie), seed)


def _causal_lm_tensors(model_class: Any, config: Any, seed: int) -> dict[str, Any]:
    """A transformers causal LM's tensors, random from ``seed``; a tied LM head is left out
    (the checkpoint stores the embedding once)."""
    with _seeded(seed):
        model = model_class(config)
    tensors = dict(model.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return tensors


def _add_diff_tensors(tensors: dict[str, Any], num_layers: int, names: Sequence[str],
                      seed: int, noise_std: float) -> None:
    """Orthrus's diffusion-view copies: per layer, each attention tensor ``NAME`` gets a
    ``NAME_diff`` equal to it plus N(0, ``noise_std``^2) noise drawn from ``seed + 1``."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    for i in range(num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for name in names:
            ar = tensors[f"{prefix}{name}.weight"]
            noise = torch.randn(ar.shape, generator=generator, dtype=ar.dtype) * noise_std
            tensors[f"{prefix}{name}_diff.weight"] = ar + noise


def _qwen2_tensors(sizes: dict[str, int], seed: int) -> dict[str, Any]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **{k: sizes[k] for k in _MODEL_SIZE_KEYS if k != "head_dim"}, tie_word_embeddings=False
    )
    if sizes["hidden_size"] // sizes["num_attention_heads"] != sizes["head_dim"]:
        raise ValueError("Qwen2-based layouts need head_dim == hidden_size // num_attention_heads")
    with _seeded(seed):
        model = Qwen2ForCausalLM(config)
    return dict(model.state_dict())


def _torch_dtype(dtype: str) -> Any:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    return dtypes[dtype]


def _save_tensors(file: Path, tensors: dict[str, Any], dtype: str) -> None:
    from safetensors.torch import save_file

    target = _torch_dtype(dtype)
    save_file(
        {k: v.detach().to(target).contiguous() for k, v in tensors.items()},
        str(file),
        metadata={"format": "pt"},
    )
    file.chmod(0o644)


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _finish(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, Any],
    dtype: str,
    overrides: dict[str, Any],
    generation: dict[str, Any] | None,
) -> Path:
    """Apply ``overrides`` (None: drop the key), write config.json, generation_config.json
    and the tensors; the folder, which every writer returns."""
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    _write_json(path / "config.json", config)
    if generation is not None:
        _write_json(path / "generation_config.json", generation)
    _save_tensors(path / "model.safetensors", tensors, dtype)
    return path


def _write_peft_lora(
    folder: Path, model: Any, rank: int, alpha: int, seed: int, dtype: str
) -> None:
    """Write a LoRA on ``o_proj`` exactly as ``PeftModel.save_pretrained`` does (random A
    and B, so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["o_proj"], lora_dropout=0.0,
                        init_lora_weights=False)  # fmt: skip
    with _seeded(seed):
        peft_model = get_peft_model(model, config)
    peft_model.to(_torch_dtype(dtype))
    peft_model.save_pretrained(str(folder))
