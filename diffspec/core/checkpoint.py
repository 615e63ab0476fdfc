"""Engine-free checkpoint inspection: which published layout a folder holds, and whether
it can serve a given decoding method.

Design notes: docs/design/core.md (section ``diffspec/core/checkpoint.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffspec.methods import FAMILIES, METHODS

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "inspect_checkpoint",
    "max_block_tokens",
    "orthrus_weights_missing",
    "require_method",
    "resolve_checkpoint",
    "validate_block_size",
]

LORA_DIR = "linear_spec_lora"
# Orthrus architecture (registry) -> its base model_type.
ORTHRUS_BASES = {arch: "llama" if "Llama" in arch else "qwen3"
                 for arch in FAMILIES["orthrus"].architectures}
# The *_diff tensors of one layer, per base: Llama attention has no q/k norms.
ORTHRUS_DIFF_WEIGHTS = {
    "qwen3": ("q_proj_diff.weight", "k_proj_diff.weight", "v_proj_diff.weight",
              "o_proj_diff.weight", "q_norm_diff.weight", "k_norm_diff.weight"),
    "llama": ("q_proj_diff.weight", "k_proj_diff.weight", "v_proj_diff.weight",
              "o_proj_diff.weight"),
}
# Fast-dLLM v2 keeps its mask token in the tokenizer only (``|<MASK>|``), not in config.json.
FAST_DLLM_V2_MASK_TOKEN = "|<MASK>|"

_SHIFTED_FAMILIES = ("orthrus", "dream", "fast_dllm_v2")


class CheckpointError(ValueError):
    """A checkpoint cannot be found, or lacks what a method needs (the message says what)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What diffspec needs to know about a checkpoint, read from its files alone."""

    path: Path
    # "qwen3" | "orthrus" | "nld" | "llada" | "dream" | "fast_dllm_v2" | "refusion" | None
    family: str | None
    architecture: str | None  # config["architectures"][0]
    model_type: str | None
    block_size: int | None  # trained diffusion block (Orthrus/NLD block_size, Fast-dLLM v2 bd_size)
    mask_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json then generation_config.json, deduplicated
    logits_shift: bool  # True: draft position j predicts token j+1
    vocab_size: int | None  # rows of the embedding matrix
    num_layers: int | None
    weight_names: frozenset[str] = field(repr=False)
    lora_path: Path | None  # NLD's linear_spec_lora/ when present
    config: dict[str, Any] = field(repr=False)

    @property
    def orthrus_base(self) -> str | None:
        """The base ``model_type`` of an Orthrus-style checkpoint: ``"llama"`` for
        ``OrthrusLlamaForCausalLM`` or a Llama config, ``"qwen3"`` for the Qwen3
        architectures and ``model_type`` ``qwen3`` / ``orthrus``; ``None`` otherwise."""
        if self.architecture in ORTHRUS_BASES:
            return ORTHRUS_BASES[self.architecture]
        model_type = (self.model_type or "").lower()
        if model_type in ("qwen3", "orthrus"):
            return "qwen3"
        return "llama" if model_type == "llama" else None


def resolve_checkpoint(name_or_path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """Return the local folder for a path or a hub id; hub ids resolve from the local
    Hugging Face cache only (``snapshot_download(..., local_files_only=True)``;
    ``cache_dir`` overrides the default cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise CheckpointError(f"checkpoint {name_or_path!s} is a file, expected a folder")
    name = str(name_or_path)
    if not _looks_like_hub_id(name):
        raise CheckpointError(f"checkpoint folder {name} does not exist")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id=name,
            local_files_only=True,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
        )
        return Path(folder)
    except Exception as exc:  # LocalEntryNotFoundError, bad repo id, offline mode, ...
        raise CheckpointError(
            f"checkpoint {name} is not a local folder and is not in the Hugging Face cache; "
            f"diffspec never downloads at run time, so download it first "
            f"(`hf download {name}`) or pass a local path"
        ) from exc


def inspect_checkpoint(name_or_path: str | Path) -> CheckpointInfo:
    """Read config, generation config, tensor names and the LoRA folder of a checkpoint."""
    path = resolve_checkpoint(name_or_path)
    config = _read_json(path / "config.json", required=True)
    architectures = config.get("architectures") or []
    architecture = architectures[0] if architectures else None
    model_type = config.get("model_type")
    weight_names = _weight_names(path)
    family = _family(architecture, model_type, config, weight_names)

    block_size = config.get("bd_size") if family == "fast_dllm_v2" else config.get("block_size")
    mask_token_id = config.get("mask_token_id")
    if mask_token_id is None and family == "fast_dllm_v2":
        mask_token_id = _tokenizer_token_id(path, FAST_DLLM_V2_MASK_TOKEN)
    generation_config = _read_json(path / "generation_config.json", required=False)
    eos = _as_ids(config.get("eos_token_id")) + _as_ids(generation_config.get("eos_token_id"))
    vocab_size = config.get("embedding_size") or config.get("vocab_size")
    num_layers = config.get("num_hidden_layers", config.get("n_layers"))
    lora_path = path / LORA_DIR if (path / LORA_DIR).is_dir() else None
    return CheckpointInfo(
        path=path,
        family=family,
        architecture=architecture,
        model_type=model_type,
        block_size=int(block_size) if block_size is not None else None,
        mask_token_id=int(mask_token_id) if mask_token_id is not None else None,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        logits_shift=_logits_shift(family, config),
        vocab_size=int(vocab_size) if vocab_size is not None else None,
        num_layers=int(num_layers) if num_layers is not None else None,
        weight_names=frozenset(weight_names),
        lora_path=lora_path,
        config=config,
    )


def require_method(info: CheckpointInfo, method: str) -> None:
    """Raise :class:`CheckpointError` naming exactly what ``info`` lacks to serve ``method``."""
    known = [m.name for m in METHODS.values() if m.families]
    if method not in known:
        raise CheckpointError(f"unknown method {method!r}; methods that need a particular "
                              f"checkpoint: {', '.join(known)}")
    families = METHODS[method].families
    name = info.path
    if method == "orthrus" and (
        info.family in ("orthrus", "qwen3", "refusion") or info.orthrus_base == "llama"
    ):
        _require_orthrus_weights(info)
    elif method == "refusion" and info.family == "qwen3":
        raise CheckpointError(
            f"checkpoint {name} is a Qwen3 checkpoint with no mask_token_id in config.json; "
            f"ReFusion needs the id of its <|mask|> token there"
        )
    elif info.family not in families:
        wanted = " or ".join(families)
        raise CheckpointError(
            f"method {method!r} needs a checkpoint of family {wanted}; checkpoint {name} is family "
            f"{info.family!r} (architecture {info.architecture!r}, model_type {info.model_type!r})"
        )
    if info.family == "nld":
        missing = [
            w
            for w in ("encoder.embed_tokens.weight", "diffusion_head.weight")
            if w not in info.weight_names
        ]
        if missing:
            raise CheckpointError(
                f"checkpoint {name} has no {' or '.join(missing)}; not an NLD checkpoint"
            )
        if info.lora_path is not None:
            _check_lora(info.lora_path)
    if METHODS[method].trained_block or info.family == "fast_dllm_v2":
        key = "bd_size" if info.family == "fast_dllm_v2" else "block_size"
        if info.block_size is None:
            raise CheckpointError(
                f"checkpoint {name} has no {key} in config.json; method {method!r} needs it"
            )
        if info.block_size < 2:
            raise CheckpointError(
                f"checkpoint {name} has {key}={info.block_size}; method {method!r} needs >= 2"
            )
    _require_mask_token(info, method)


def max_block_tokens(info: CheckpointInfo) -> int | None:
    """The most tokens a step may ask of this checkpoint, or ``None`` for no trained limit.

    Orthrus and NLD draft ``block_size - 1`` tokens (the block's first slot is the anchor);
    a TiDAR checkpoint drafts ``block_size`` tokens when its drafts are shifted, else
    ``block_size - 1``; Fast-dLLM v2 decodes blocks of at most ``bd_size``.
    """
    if info.block_size is None:
        return None
    if info.family in ("orthrus", "nld") or (info.family == "tidar" and not info.logits_shift):
        return info.block_size - 1
    return info.block_size


def validate_block_size(info: CheckpointInfo, requested: int) -> None:
    """Raise when ``requested`` (draft tokens, or block length for Fast-dLLM v2) does not
    fit what the checkpoint was trained for."""
    if requested < 1:
        raise CheckpointError(f"requested block/draft length {requested} must be >= 1")
    limit = max_block_tokens(info)
    if limit is None or requested <= limit:
        return
    if info.family in ("orthrus", "nld", "tidar"):
        raise CheckpointError(
            f"checkpoint {info.path} was trained with block_size={info.block_size}, "
            f"so it drafts at most "
            f"{limit} tokens per step (block = anchor + {limit} masks); {requested} requested"
        )
    raise CheckpointError(
        f"checkpoint {info.path} was trained with block size {info.block_size}; "
        f"a block of {requested} tokens is larger"
    )


# ---------------------------------------------------------------------------- internals


def orthrus_weights_missing(missing: Sequence[str], unit: str, *, norms: bool) -> ValueError:
    """The error an engine's Orthrus model raises when the weights it loaded lacked
    diffusion tensors: ``missing`` (sorted names), counted in ``unit`` ("tensors",
    "parameters"); ``norms``: the layout has q/k norm copies too (Qwen3)."""
    expected = "{q,k,v,o}_proj_diff" + (" and {q,k}_norm_diff" if norms else "")
    return ValueError(
        f"the checkpoint has no Orthrus diffusion weights for {missing[0]} ({len(missing)} "
        f"{unit} missing); expected model.layers.N.self_attn.{expected} for every layer")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not name.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for c in name.replace("/", ""))
    )


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"checkpoint folder {path.parent} has no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _safetensors_names(path: Path) -> list[str]:
    """Tensor names from a safetensors header: u64 little-endian length, then JSON."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return [k for k in header if k != "__metadata__"]


def _weight_names(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(_read_json(index, required=True).get("weight_map", {}))
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        names.extend(_safetensors_names(file))
    return names


def _family(
    architecture: str | None, model_type: str | None, config: dict[str, Any], names: list[str]
) -> str | None:
    """The first registry family (:data:`diffspec.methods.FAMILIES`) whose architecture or
    model_type the checkpoint has and whose required config keys it holds; Orthrus also by
    its ``*_diff`` tensors (a Qwen3 / Llama config with diffusion weights)."""
    if any("_diff." in n for n in names):
        return "orthrus"
    mt = (model_type or "").lower()
    for family in FAMILIES.values():
        if architecture in family.architectures or mt in family.model_types:
            if all(config.get(k) is not None for k in family.required_config):
                return family.name
    return None


def _logits_shift(family: str | None, config: dict[str, Any]) -> bool:
    if family in ("nld", "tidar"):
        return config.get("dlm_type") == "dream"
    return family in _SHIFTED_FAMILIES


def _tokenizer_token_id(path: Path, token: str) -> int | None:
    """The id of ``token`` among the tokenizer's added tokens, if the folder has one."""
    tok = _read_json(path / "tokenizer.json", required=False)
    for added in tok.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    decoder = _read_json(path / "tokenizer_config.json", required=False).get(
        "added_tokens_decoder", {}
    )
    for idx, entry in decoder.items():
        if entry.get("content") == token:
            return int(idx)
    return None


def _require_orthrus_weights(info: CheckpointInfo) -> None:
    base = info.orthrus_base
    if base is None:
        raise CheckpointError(
            f"checkpoint {info.path} is an Orthrus checkpoint on an unsupported base "
            f"(architecture {info.architecture!r}, model_type {info.model_type!r}); Orthrus "
            f"runs on Qwen3 ({', '.join(a for a, b in ORTHRUS_BASES.items() if b == 'qwen3')})"
            f" and Llama (OrthrusLlamaForCausalLM, model_type 'llama')"
        )
    layers = info.num_layers
    if layers is None:
        layers = 1 + max(
            (int(n.split(".")[2]) for n in info.weight_names if n.startswith("model.layers.")),
            default=0,
        )
    missing = [
        f"model.layers.{i}.self_attn.{w}"
        for i in range(layers)
        for w in ORTHRUS_DIFF_WEIGHTS[base]
        if f"model.layers.{i}.self_attn.{w}" not in info.weight_names
    ]
    if not missing:
        return
    modules = "q/k/v/o_proj_diff" + (", q/k_norm_diff" if base == "qwen3" else "")
    expected = f"(and {modules} for each of {layers} layers)"
    if not any("_diff." in n for n in info.weight_names):
        name = {"qwen3": "Qwen3", "llama": "Llama"}[base]
        raise CheckpointError(
            f"checkpoint {info.path} has no diffusion weights: expected {missing[0]} {expected}; "
            f"is this the base {name} rather than an Orthrus checkpoint?"
        )
    raise CheckpointError(
        f"checkpoint {info.path} lacks {len(missing)} Orthrus diffusion weights, "
        f"first {missing[0]} {expected}"
    )


def _require_mask_token(info: CheckpointInfo, method: str) -> None:
    if info.mask_token_id is None:
        where = (
            f"config.json nor the tokenizer ({FAST_DLLM_V2_MASK_TOKEN})"
            if info.family == "fast_dllm_v2"
            else "config.json"
        )
        raise CheckpointError(
            f"checkpoint {info.path} has no mask_token_id in {where}; method {method!r} needs it"
        )
    if info.vocab_size is not None and not 0 <= info.mask_token_id < info.vocab_size:
        raise CheckpointError(
            f"checkpoint {info.path} has mask_token_id={info.mask_token_id}, "
            f"outside its vocabulary "
            f"[0, {info.vocab_size})"
        )


def _check_lora(lora: Path) -> None:
    """A PEFT LoRA folder: adapter_config.json (peft_type LORA, target_modules) plus
    adapter_model.safetensors holding lora_A / lora_B tensors."""
    config_path = lora / "adapter_config.json"
    if not config_path.is_file():
        raise CheckpointError(f"LoRA folder {lora} has no adapter_config.json")
    config = _read_json(config_path, required=True)
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise CheckpointError(
            f"{config_path} has peft_type={config.get('peft_type')!r}, expected 'LORA'"
        )
    if not config.get("target_modules"):
        raise CheckpointError(f"{config_path} names no target_modules")
    if not config.get("r"):
        raise CheckpointError(f"{config_path} has no rank r")
    weights = lora / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"LoRA folder {lora} has no adapter_model.safetensors")
    names = _safetensors_names(weights)
    for part in ("lora_A", "lora_B"):
        if not any(f".{part}." in n for n in names):
            raise CheckpointError(f"{weights} holds no {part} tensors")
