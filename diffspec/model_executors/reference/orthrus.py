"""Orthrus: a frozen AR model (the AR view) plus per-layer diffusion attention projections.

Design notes: docs/design/reference.md (section ``diffspec/model_executors/reference/orthrus.py``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from diffspec.core.checkpoint import (
    ORTHRUS_BASES,
    CheckpointError,
    inspect_checkpoint,
    require_method,
)
from diffspec.model_executors.reference.loading import from_pretrained_strict
from diffspec.model_executors.reference.views import anchor_block, block_view_logits

__all__ = [
    "DIFF_MODULES",
    "HEADS_CONFIG",
    "HEADS_WEIGHTS",
    "DenseDelta",
    "FULL_RANK",
    "LowRankDelta",
    "OrthrusModel",
    "base_weights_sha256",
    "load_orthrus",
    "load_orthrus_heads",
    "materialize_orthrus",
    "orthrus_from_base",
    "save_orthrus",
    "save_orthrus_heads",
]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
DIFF_MODULES = (*PROJECTIONS, "q_norm", "k_norm")  # what a layer may have; Llama: no norms
HEADS_CONFIG, HEADS_WEIGHTS, HEADS_FORMAT = "heads.json", "heads.safetensors", "orthrus-heads"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")
_HEADS_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float32": torch.float32}


def diff_module_names(attn: nn.Module) -> tuple[str, ...]:
    """The attention modules of ``attn`` that Orthrus mirrors (those of :data:`DIFF_MODULES`
    it has): Qwen3 all six, Llama the four projections."""
    return tuple(name for name in DIFF_MODULES if name in attn._modules)


@dataclass(eq=False)
class OrthrusModel:
    """An Orthrus checkpoint in memory: the base ``lm`` (with ``*_diff`` modules) and the
    diffusion-drafting settings from its config."""

    lm: nn.Module  # Qwen3ForCausalLM or LlamaForCausalLM; its forward is the AR view
    block_size: int  # K: anchor + K-1 masks per diffusion block
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    source: Path | None = None  # folder the weights (and tokenizer) came from

    @property
    def config(self):
        return self.lm.config

    @property
    def rank(self) -> int | str | None:
        """The rank of the ``*_diff`` projections' deltas (``"full"``: dense deltas), or
        ``None`` (full weights, no deltas)."""
        deltas = [m for m in self.lm.modules() if isinstance(m, (LowRankDelta, DenseDelta))]
        return deltas[0].rank if deltas else None

    def diffusion_parameters(self) -> list[nn.Parameter]:
        """The ``*_diff`` parameters only (what the Orthrus trainer updates): full weights,
        or the low-rank factors (and diff norms) of low-rank heads."""
        return [p for n, p in self.lm.named_parameters() if "_diff." in n]

    @contextlib.contextmanager
    def diffusion_view(self) -> Iterator[None]:
        """Run ``self.lm`` as the diffusion view inside the block: every layer's attention
        projections (and q/k norms) are swapped for the ``*_diff`` ones, then restored."""
        attns = [layer.self_attn for layer in self.lm.model.layers]
        if getattr(self.lm, "_diffspec_in_diffusion_view", False):
            raise RuntimeError("diffusion_view() is already active (it does not nest)")
        saved = [{name: getattr(a, name) for name in diff_module_names(a)} for a in attns]
        self.lm._diffspec_in_diffusion_view = True
        try:
            for attn, modules in zip(attns, saved):
                for name in modules:
                    attn._modules[name] = attn._modules[f"{name}_diff"]
            yield
        finally:
            for attn, modules in zip(attns, saved):
                attn._modules.update(modules)
            self.lm._diffspec_in_diffusion_view = False

    def diffusion_logits(
        self,
        input_ids: Tensor,  # [n] or [batch, n]
        position_ids: Tensor,  # [n] or [batch, n]
        cache=None,  # DynamicCache of the committed tokens (AR KV), or None
        attention_mask: Tensor | None = None,  # [n, cache_len + n] bool; None = bidirectional
        keep_kv: bool = False,
    ) -> Tensor:  # [n, vocab] or [batch, n, vocab]
        """:func:`~diffspec.model_executors.reference.views.block_view_logits` in the diffusion view.

        Training (Orthrus dual pass): fill ``cache`` with the AR view over the clean
        sequence (``lm(clean, past_key_values=cache, use_cache=True)``, no grad needed: the
        AR weights are frozen), then call this once with all noisy blocks, their
        ``position_ids[L:]`` and the rows ``mask[L:]`` of
        :func:`diffspec.core.masks.orthrus_dual_pass_mask`; gradients reach the ``*_diff``
        weights. The clean rows must not run here: they belong to the AR view."""
        with self.diffusion_view():
            return block_view_logits(self.lm, input_ids, position_ids, cache, attention_mask,
                                     keep_kv)

    def draft_logits(self, anchor: int, cache, num_drafts: int) -> Tensor:  # [num_drafts, vocab]
        """One diffusion pass over ``[anchor, <mask> x num_drafts]`` at positions
        ``cache_len .. cache_len + num_drafts``; block K/V are not kept. Shifted: block
        position ``j`` predicts the token after it, so the drafts are ``logits[:-1]``."""
        block, positions = anchor_block(anchor, self.mask_token_id, cache.get_seq_length(),
                                        num_drafts, self.lm.device)
        return self.diffusion_logits(block, positions, cache)[:-1].float()


# --------------------------------------------------------------------- low-rank heads


def merge_low_rank(
    weight: Tensor,  # [out, in] the frozen AR projection
    lora_a: Tensor,  # [rank, in]
    lora_b: Tensor,  # [out, rank]
) -> Tensor:  # [out, in], weight's dtype
    """``W + B @ A``, accumulated in fp64 and rounded once to ``W``'s dtype: the export of
    a low-rank projection (:func:`orthrus_state_dict`, so :func:`save_orthrus` and
    :func:`materialize_orthrus`). bf16 / fp16 / fp32 factors are exact in fp64, so the
    result is the same bits whatever the factors' storage dtype or the BLAS thread count
    (the fp64 sum's order cannot move an fp32 rounding in practice)."""
    return (weight.double() + lora_b.double() @ lora_a.double()).to(weight.dtype)


class LowRankDelta(nn.Module):
    """A ``*_diff`` projection parameterized as the AR projection plus ``B @ A``, computed
    in LoRA form: ``x W^T + b + (x A^T) B^T`` (the frozen AR projection plus the low-rank
    path; no ``[out, in]`` weight is formed in training or inference). It equals the
    merged projection ``x (W + B A)^T + b`` up to fp rounding; :meth:`merged_weight` is
    the merge the export writes.

    The AR ``nn.Linear`` is referenced, not registered: its weight stays the AR view's
    (frozen, saved once under its AR name), and this module's state is only ``lora_A``
    ``[rank, in]`` and ``lora_B`` ``[out, rank]``. ``B`` starts at zero, so a fresh delta
    computes exactly the AR projection."""

    def __init__(self, ar: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.__dict__["ar"] = ar  # plain attribute: not a submodule, not in the state dict
        out_features, in_features = ar.weight.shape
        a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
        self.lora_A = nn.Parameter(a.to(ar.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=ar.weight.dtype))

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]

    def merged_weight(self) -> Tensor:  # [out, in]
        """``W + B @ A`` (:func:`merge_low_rank`): the weight the export writes."""
        return merge_low_rank(self.ar.weight, self.lora_A, self.lora_B)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        frozen = nn.functional.linear(x, self.ar.weight, self.ar.bias)  # [..., out]
        low_rank = nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B)
        return frozen + low_rank  # x W^T + b + (x A^T) B^T


FULL_RANK = "full"  # heads.json "rank" of dense deltas (DenseDelta)


def _rank(rank: int | str) -> int:
    if not isinstance(rank, int):
        raise ValueError(f"rank must be a positive integer or {FULL_RANK!r}, got {rank!r}")
    return rank


class DenseDelta(nn.Module):
    """A ``*_diff`` projection parameterized as the AR projection plus a dense ``delta``
    ``[out, in]`` (zero at the start): every weight of the projection trains, as in the
    Orthrus paper, while the stored heads hold only the difference from the AR weight
    (small, so bf16 keeps it close). Like :class:`LowRankDelta` the AR ``nn.Linear`` is
    referenced, not registered, and weight decay pulls the head toward the AR view."""

    def __init__(self, ar: nn.Linear) -> None:
        super().__init__()
        self.__dict__["ar"] = ar  # plain attribute: not a submodule, not in the state dict
        self.delta = nn.Parameter(torch.zeros_like(ar.weight))

    @property
    def rank(self) -> str:
        return FULL_RANK

    def merged_weight(self) -> Tensor:  # [out, in]
        """``W + delta``, summed in fp64 and rounded once to ``W``'s dtype."""
        return (self.ar.weight.double() + self.delta.double()).to(self.ar.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        return nn.functional.linear(x, self.ar.weight + self.delta, self.ar.bias)


# ------------------------------------------------------------------------------ building


def _attach_diffusion_modules(lm: nn.Module, rank: int | str | None = None,
                              seed: int = 0) -> None:
    """Give every layer's attention ``*_diff`` twins of its AR projections (and norms):
    copies, or with ``rank`` :class:`LowRankDelta` projections (``rank="full"``:
    :class:`DenseDelta`; norms are still copies)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lm.model.layers:
        attn = layer.self_attn
        for name in diff_module_names(attn):
            ar = getattr(attn, name)
            if rank == FULL_RANK and name in PROJECTIONS:
                attn.add_module(f"{name}_diff", DenseDelta(ar))
            elif rank is not None and name in PROJECTIONS:
                attn.add_module(f"{name}_diff", LowRankDelta(ar, _rank(rank), generator))
            else:
                attn.add_module(f"{name}_diff", copy.deepcopy(ar))


def _base_classes(base: str):
    """(config class, model class) of a base model type."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "llama": (LlamaConfig, LlamaForCausalLM)}[base]


def _base_config(base: str, config: dict):
    """The base's transformers config from an Orthrus config.json (extra keys such as
    ``block_size`` stay attributes)."""
    skip = ("model_type", "architectures", "auto_map", "transformers_version")
    config_class, _ = _base_classes(base)
    return config_class(**{k: v for k, v in config.items() if k not in skip})


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _safetensors_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in path.glob("*.safetensors") if p.name != HEADS_WEIGHTS)


def _diff_tensors(info) -> dict[str, Tensor]:
    """Every ``*_diff`` tensor of the checkpoint, read from its safetensors files."""
    from safetensors import safe_open

    tensors = {}
    for file in _safetensors_files(info.path):
        with safe_open(str(info.path / file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if "_diff." in k})
    return tensors


def _load_base_lm(path: Path, base: str, config: dict, dtype: torch.dtype) -> nn.Module:
    """The base model class from ``path`` (strict: no missing AR tensor), ignoring any
    ``*_diff`` tensors there."""
    from transformers.utils import logging as hf_logging

    _, model_class = _base_classes(base)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the *_diff tensors are "unexpected" to the base: expected
    try:
        return from_pretrained_strict(model_class, path, config=_base_config(base, config),
                                      dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)


def load_orthrus(path: str | Path, dtype: torch.dtype = torch.float32) -> OrthrusModel:
    """Load an Orthrus checkpoint (Qwen3: ``OrthrusLM`` / ``OrthrusForCausalLM``,
    ``model_type`` ``qwen3`` or ``orthrus``; Llama: ``OrthrusLlamaForCausalLM``,
    ``model_type`` ``llama``) without remote code: the AR weights into the stock base
    class, the ``*_diff`` weights into its per-layer diffusion modules. Raises
    :class:`~diffspec.core.checkpoint.CheckpointError` naming what is missing."""
    info = inspect_checkpoint(path)
    require_method(info, "orthrus")
    base = info.orthrus_base
    assert base is not None  # require_method checked the family
    lm = _load_base_lm(info.path, base, info.config, dtype)
    _attach_diffusion_modules(lm)
    diff = _diff_tensors(info)
    missing = [k for k in lm.state_dict() if "_diff." in k and k not in diff]
    if missing:
        raise CheckpointError(f"checkpoint {info.path} lacks {missing[0]} "
                              f"({len(missing)} diffusion tensors missing)")
    lm.load_state_dict(diff, strict=False)
    lm.to(dtype).eval()
    assert info.mask_token_id is not None and info.block_size is not None  # require_method
    return OrthrusModel(lm, info.block_size, info.mask_token_id, info.eos_token_ids, info.path)


def orthrus_from_base(
    base: str | Path | nn.Module,
    block_size: int = 32,
    mask_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    rank: int | str | None = None,
    seed: int = 0,
) -> OrthrusModel:
    """An Orthrus model on a base Qwen3 or Llama whose diffusion projections start as the
    AR projections (the trainer's starting point): copies, or with ``rank`` low-rank
    deltas ``W + B @ A`` with ``B = 0`` (``A`` drawn from ``seed``), or with
    ``rank="full"`` dense deltas ``W + delta`` with ``delta = 0``. ``base`` is a
    checkpoint folder or a loaded ``*ForCausalLM`` (used in place). ``mask_token_id``
    defaults to the folder tokenizer's ``mask_token``; a vocabulary without a spare row
    (Llama) takes an existing token id, which must be < ``vocab_size``."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one mask), got {block_size}")
    source = None
    if isinstance(base, nn.Module):
        lm = base
    else:
        from transformers import AutoModelForCausalLM

        source = Path(base)
        lm = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    if lm.config.model_type not in ORTHRUS_BASES.values():
        raise CheckpointError(f"Orthrus needs a base model of model_type "
                              f"{' or '.join(sorted(set(ORTHRUS_BASES.values())))}, got "
                              f"{lm.config.model_type!r}")
    if mask_token_id is None:
        mask_token_id = _tokenizer_mask_id(source)
    if not 0 <= mask_token_id < lm.config.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} outside the vocabulary "
                         f"[0, {lm.config.vocab_size})")
    _attach_diffusion_modules(lm, rank, seed)
    lm.eval()
    eos = _eos_ids(getattr(lm.generation_config, "eos_token_id", None)) or _eos_ids(
        lm.config.eos_token_id)
    return OrthrusModel(lm, block_size, mask_token_id, eos, source)


def _tokenizer_mask_id(source: Path | None) -> int:
    if source is None:
        raise ValueError("mask_token_id is required when the base is a model object")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.mask_token_id is None:
        raise ValueError(f"the tokenizer in {source} has no mask_token; pass mask_token_id "
                         f"(any id < vocab_size; a Llama vocabulary has no spare row, so an "
                         f"existing, rarely used token serves as the mask)")
    return int(tokenizer.mask_token_id)


def _default_architecture(base: str) -> str:
    return next(arch for arch, b in ORTHRUS_BASES.items() if b == base)


def orthrus_state_dict(model: OrthrusModel) -> dict[str, Tensor]:
    """The model's tensors under the published names: AR weights plus full ``*_diff``
    weights (low-rank projections materialized with :func:`merge_low_rank`)."""
    lm = model.lm
    tensors = {k: v.detach() for k, v in lm.state_dict().items()
               if ".lora_" not in k and not k.endswith("_diff.delta")}
    for name, module in lm.named_modules():
        if isinstance(module, (LowRankDelta, DenseDelta)):
            tensors[f"{name}.weight"] = module.merged_weight().detach()
            if module.ar.bias is not None:
                tensors[f"{name}.bias"] = module.ar.bias.detach()
    if lm.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in tensors.items()}


def save_orthrus(
    model: OrthrusModel,
    path: str | Path,
    architecture: str | None = None,
    model_type: str | None = None,
) -> Path:
    """Write ``model`` in the published Orthrus layout: config.json (base keys plus
    ``block_size``, ``mask_token_id``, ``eos_token_id``), model.safetensors (AR names and
    ``*_diff`` names; low-rank projections materialized), generation_config.json, and the
    tokenizer files of its source. Defaults: Qwen3 ``OrthrusLM`` / ``qwen3``, Llama
    ``OrthrusLlamaForCausalLM`` / ``llama``."""
    from safetensors.torch import save_file

    lm = model.lm
    base = lm.config.model_type
    architecture = architecture or _default_architecture(base)
    model_type = model_type or base
    if ORTHRUS_BASES.get(architecture) != base:
        allowed = [a for a, b in ORTHRUS_BASES.items() if b == base]
        raise ValueError(f"architecture for a {base} base must be one of {allowed}, "
                         f"got {architecture!r}")
    if model_type not in ((base, "orthrus") if base == "qwen3" else (base,)):
        raise ValueError(f"model_type {model_type!r} does not fit a {base} base")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = lm.config.to_dict()
    config.pop("_name_or_path", None)  # machine-local path of the source; not part of the layout
    eos = list(model.eos_token_ids)
    config.update(architectures=[architecture], model_type=model_type,
                  block_size=model.block_size, mask_token_id=model.mask_token_id,
                  eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(orthrus_state_dict(model), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # safetensors writes 0600; checkpoints get shared
    lm.generation_config.save_pretrained(str(path))
    if model.source is not None:
        _copy_tokenizer(model.source, path)
    return path


def _copy_tokenizer(source: Path, path: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (source / name).is_file() and source.resolve() != path.resolve():
            shutil.copyfile(source / name, path / name)


# ------------------------------------------------------------------------ heads folder


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64"}


def base_weights_sha256(base: str | Path | nn.Module) -> str:
    """A sha256 of the base model's AR tensors, independent of file layout: over the
    tensors sorted by name, each as name, safetensors dtype, shape and raw bytes
    (``*_diff`` tensors and a tied ``lm_head.weight`` excluded). ``base`` is a checkpoint
    folder (read from the safetensors files, no model built) or a loaded model."""
    digest = hashlib.sha256()

    def add(name: str, dtype: str, shape: list[int], data: bytes) -> None:
        digest.update(json.dumps([name, dtype, list(shape)]).encode() + b"\n")
        digest.update(data)

    if isinstance(base, nn.Module):
        state = {k: v for k, v in base.state_dict().items() if "_diff." not in k}
        if base.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        for name in sorted(state):
            t = state[name].detach().cpu().contiguous()
            add(name, _ST_DTYPES[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    path = Path(base)
    entries = []  # (name, file, dtype, shape, start, end)
    for file in _safetensors_files(path):
        with (path / file).open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name != "__metadata__" and "_diff." not in name:
                start, end = meta["data_offsets"]
                entries.append((name, file, meta["dtype"], meta["shape"], 8 + length + start,
                                8 + length + end))
    if not entries:
        raise CheckpointError(f"{path} holds no safetensors weights")
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    for name, file, dtype, shape, start, end in sorted(entries):
        if tied and name == "lm_head.weight":
            continue
        with (path / file).open("rb") as f:
            f.seek(start)
            add(name, dtype, shape, f.read(end - start))
    return digest.hexdigest()


def save_orthrus_heads(
    model: OrthrusModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, *,
    round_model: bool = True,
) -> Path:
    """Write the compact heads folder of a low-rank Orthrus model: ``heads.safetensors``
    (``model.layers.N.self_attn.{q,k,v,o}_proj_diff.lora_A`` ``[rank, in]`` / ``.lora_B``
    ``[out, rank]`` in ``dtype``, or ``.delta`` ``[out, in]`` for ``rank "full"``, plus
    ``{q,k}_norm_diff.weight`` on Qwen3) and
    ``heads.json`` (base architecture and sizes, rank, block_size, mask_token_id, EOS ids,
    the sha256 of the base weights, dtype). The factors are rounded to ``dtype`` *in the
    model too*, so the model in memory is the one the folder describes (``round_model=False``
    leaves the model as it is: a snapshot taken while training goes on)."""
    from safetensors.torch import save_file

    if model.rank is None:
        raise ValueError("save_orthrus_heads needs delta heads (orthrus_from_base(..., "
                         "rank=r or rank='full')); use save_orthrus for full diffusion weights")
    name = {v: k for k, v in _HEADS_DTYPES.items()}.get(dtype)
    if name is None:
        raise ValueError(f"heads dtype must be one of {', '.join(_HEADS_DTYPES)}, got {dtype}")
    lm = model.lm
    if round_model:
        with torch.no_grad():
            for p in model.diffusion_parameters():
                p.copy_(p.to(dtype))  # round in place: memory == file
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in lm.state_dict().items()
               if "_diff." in k}
    base = model.source if model.source is not None else lm
    config = lm.config
    record = {
        "format": HEADS_FORMAT,
        "base_architecture": (config.architectures or [None])[0],
        "base_model_type": config.model_type,
        "orthrus_architecture": _default_architecture(config.model_type),
        "base_name": model.source.name if model.source is not None else None,
        "base_sha256": base_weights_sha256(base),
        "rank": model.rank,
        "block_size": model.block_size,
        "mask_token_id": model.mask_token_id,
        "eos_token_ids": list(model.eos_token_ids),
        "dtype": name,
        "shapes": {k: config.to_dict().get(k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / HEADS_WEIGHTS), metadata={"format": "pt"})
    (out / HEADS_WEIGHTS).chmod(0o644)
    (out / HEADS_CONFIG).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out


def read_heads_config(heads_dir: str | Path) -> dict[str, Any]:
    heads = Path(heads_dir)
    file = heads / HEADS_CONFIG
    if not file.is_file() or not (heads / HEADS_WEIGHTS).is_file():
        raise CheckpointError(f"{heads} is not an Orthrus heads folder (needs {HEADS_CONFIG} "
                              f"and {HEADS_WEIGHTS})")
    record = json.loads(file.read_text())
    if record.get("format") != HEADS_FORMAT:
        raise CheckpointError(f"{file} has format {record.get('format')!r}, "
                              f"expected {HEADS_FORMAT!r}")
    return record


def load_orthrus_heads(
    base: str | Path, heads_dir: str | Path, dtype: torch.dtype = torch.float32
) -> OrthrusModel:
    """The base checkpoint plus a heads folder, as a low-rank :class:`OrthrusModel`
    (projections ``W + B @ A`` in LoRA form; :func:`materialize_orthrus` writes them
    merged). Refuses a base whose
    architecture, shapes or weights (sha256) differ from the one the heads were trained
    against."""
    from safetensors.torch import load_file

    from diffspec.core.checkpoint import resolve_checkpoint

    base = resolve_checkpoint(base)
    record = read_heads_config(heads_dir)
    _check_base(base, record)
    model = orthrus_from_base(base, record["block_size"], record["mask_token_id"], dtype,
                              rank=record["rank"])
    factors = load_file(str(Path(heads_dir) / HEADS_WEIGHTS))
    own = dict(model.lm.named_parameters())
    expected = {k for k in own if "_diff." in k}
    if set(factors) != expected:
        extra, lacking = sorted(set(factors) - expected), sorted(expected - set(factors))
        raise CheckpointError(f"{heads_dir} does not fit {base}: "
                              f"{'unexpected ' + extra[0] if extra else 'missing ' + lacking[0]}")
    with torch.no_grad():
        for name, tensor in factors.items():
            if own[name].shape != tensor.shape:
                raise CheckpointError(f"{heads_dir}: {name} has shape {tuple(tensor.shape)}, "
                                      f"the base needs {tuple(own[name].shape)}")
            own[name].copy_(tensor)
    model.eos_token_ids = tuple(record.get("eos_token_ids") or model.eos_token_ids)
    return model


def _check_base(base: Path, record: dict[str, Any]) -> None:
    config = json.loads((base / "config.json").read_text())
    if config.get("model_type") != record["base_model_type"]:
        raise CheckpointError(f"the heads were trained on a {record['base_model_type']} base "
                              f"({record.get('base_name')}); {base} is model_type "
                              f"{config.get('model_type')!r}")
    for key, value in record["shapes"].items():
        if value is not None and config.get(key, value) != value:
            raise CheckpointError(f"the heads were trained on a base with {key}={value}; "
                                  f"{base} has {key}={config.get(key)}")
    digest = base_weights_sha256(base)
    if digest != record["base_sha256"]:
        raise CheckpointError(f"{base} is not the base the heads were trained against "
                              f"({record.get('base_name')}): its weights' sha256 is "
                              f"{digest[:16]}..., the heads need {record['base_sha256'][:16]}...")


def materialize_orthrus(
    base_dir: str | Path,
    heads_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a full Orthrus checkpoint (the published layout vLLM and :func:`load_orthrus`
    read) from a base checkpoint and a heads folder, with the base's tokenizer files.
    ``dtype`` defaults to the base's ``torch_dtype`` (else fp32); the ``*_diff`` weights
    are :func:`merge_low_rank` of the stored factors in that dtype. Where heads.json has
    the heads' measured ``acceptance_per_position``, config.json gets it too
    (:data:`~diffspec.core.adaptive.CHECKPOINT_ACCEPTANCE_KEY`): the engines' adaptive
    policy starts from it instead of measuring from an optimistic guess."""
    from diffspec.core.adaptive import CHECKPOINT_ACCEPTANCE_KEY, measured_prior
    from diffspec.core.checkpoint import resolve_checkpoint

    base = resolve_checkpoint(base_dir)
    if dtype is None:
        config = json.loads((base / "config.json").read_text())
        dtype = _HEADS_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")),
                                  torch.float32)
    model = load_orthrus_heads(base, heads_dir, dtype)
    out = save_orthrus(model, out_dir)
    measured = read_heads_config(heads_dir).get("acceptance_per_position")
    if measured_prior(measured) is not None:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config[CHECKPOINT_ACCEPTANCE_KEY] = [float(p) for p in measured]
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def load_ar_view(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The AR view of an Orthrus checkpoint: the frozen base causal LM (registry
    ``Family.ar_view``)."""
    return load_orthrus(path, dtype=dtype).lm
