"""Orthrus: a frozen Qwen3 (the AR view) plus per-layer diffusion attention projections.

The model is a stock transformers ``Qwen3ForCausalLM``. Each decoder layer's ``self_attn``
additionally holds ``q_proj_diff, k_proj_diff, v_proj_diff, o_proj_diff, q_norm_diff,
k_norm_diff``, registered under exactly those names, so ``lm.state_dict()`` uses the
published tensor names (``model.layers.N.self_attn.q_proj_diff.weight``). The AR view is
the plain model (the ``*_diff`` modules are never called); the diffusion view swaps the six
attention modules of every layer for their ``*_diff`` twins for the duration of a call
(:meth:`OrthrusModel.diffusion_view`); embeddings, MLPs, layer norms, rotary and the LM
head are shared. Because Qwen3's attention appends the block's K/V to the cache before
attending, a diffusion-view block reads the AR KV of the committed prefix (written by the
AR projections) and its own diffusion K/V, exactly as the reference
(``chiennv2000/orthrus`` ``src/model.py``, ``OrthrusAttention``: AR cache keys
concatenated with the ``*_diff`` keys of the block, ``is_causal=False``).

Drafts are read from **shifted** logits: block position ``j`` predicts token ``j + 1``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from diffspec.core.checkpoint import (
    ORTHRUS_ARCHITECTURES,
    CheckpointError,
    inspect_checkpoint,
    require_method,
)
from diffspec.model_executors.loading import from_pretrained_strict
from diffspec.model_executors.views import anchor_block, block_view_logits

__all__ = [
    "DIFF_MODULES",
    "OrthrusModel",
    "load_orthrus",
    "orthrus_from_base",
    "save_orthrus",
]

DIFF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(eq=False)
class OrthrusModel:
    """An Orthrus checkpoint in memory: the Qwen3 ``lm`` (with ``*_diff`` modules) and the
    diffusion-drafting settings from its config."""

    lm: nn.Module  # Qwen3ForCausalLM; its forward is the AR view
    block_size: int  # K: anchor + K-1 masks per diffusion block
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    source: Path | None = None  # folder the weights (and tokenizer) came from

    @property
    def config(self):
        return self.lm.config

    def diffusion_parameters(self) -> list[nn.Parameter]:
        """The ``*_diff`` parameters only (what the Orthrus trainer updates)."""
        return [p for n, p in self.lm.named_parameters() if "_diff." in n]

    @contextlib.contextmanager
    def diffusion_view(self) -> Iterator[None]:
        """Run ``self.lm`` as the diffusion view inside the block: every layer's attention
        projections and q/k norms are swapped for the ``*_diff`` ones, then restored."""
        attns = [layer.self_attn for layer in self.lm.model.layers]
        if getattr(self.lm, "_diffspec_in_diffusion_view", False):
            raise RuntimeError("diffusion_view() is already active (it does not nest)")
        saved = [{name: getattr(a, name) for name in DIFF_MODULES} for a in attns]
        self.lm._diffspec_in_diffusion_view = True
        try:
            for attn in attns:
                for name in DIFF_MODULES:
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
        """:func:`~diffspec.model_executors.views.block_view_logits` in the diffusion view.

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


# ------------------------------------------------------------------------------ building


def _attach_diffusion_modules(lm: nn.Module) -> None:
    """Give every layer's attention ``*_diff`` copies of its AR projections and norms."""
    for layer in lm.model.layers:
        attn = layer.self_attn
        for name in DIFF_MODULES:
            attn.add_module(f"{name}_diff", copy.deepcopy(getattr(attn, name)))


def _qwen3_config(config: dict):
    """A ``Qwen3Config`` from an Orthrus config.json (``model_type`` qwen3 or orthrus)."""
    from transformers import Qwen3Config

    skip = ("model_type", "architectures", "auto_map", "transformers_version")
    return Qwen3Config(**{k: v for k, v in config.items() if k not in skip})


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _diff_tensors(info) -> dict[str, Tensor]:
    """Every ``*_diff`` tensor of the checkpoint, read from its safetensors files."""
    from safetensors import safe_open

    index = info.path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in info.path.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(info.path / file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if "_diff." in k})
    return tensors


def load_orthrus(path: str | Path, dtype: torch.dtype = torch.float32) -> OrthrusModel:
    """Load an Orthrus checkpoint (``OrthrusLM`` / ``OrthrusForCausalLM``, ``model_type``
    ``qwen3`` or ``orthrus``) without remote code: the AR weights into a stock
    ``Qwen3ForCausalLM``, the ``*_diff`` weights into its per-layer diffusion modules.
    Raises :class:`~diffspec.core.checkpoint.CheckpointError` naming what is missing."""
    from transformers import Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    info = inspect_checkpoint(path)
    require_method(info, "orthrus")
    config = _qwen3_config(info.config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the *_diff tensors are "unexpected" to Qwen3: expected
    try:
        lm = from_pretrained_strict(Qwen3ForCausalLM, info.path, config=config, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
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
) -> OrthrusModel:
    """An Orthrus model whose diffusion weights are copies of the base Qwen3's AR
    projections (the trainer's starting point). ``base`` is a checkpoint folder or a loaded
    ``Qwen3ForCausalLM`` (used in place). ``mask_token_id`` defaults to the folder
    tokenizer's ``mask_token``."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + at least one mask), got {block_size}")
    source = None
    if isinstance(base, nn.Module):
        lm = base
    else:
        from transformers import AutoModelForCausalLM

        source = Path(base)
        lm = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    if lm.config.model_type != "qwen3":
        raise CheckpointError(f"Orthrus needs a Qwen3 base model, got model_type "
                              f"{lm.config.model_type!r}")
    if mask_token_id is None:
        mask_token_id = _tokenizer_mask_id(source)
    if not 0 <= mask_token_id < lm.config.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} outside the vocabulary "
                         f"[0, {lm.config.vocab_size})")
    _attach_diffusion_modules(lm)
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
        raise ValueError(f"the tokenizer in {source} has no mask_token; pass mask_token_id")
    return int(tokenizer.mask_token_id)


def save_orthrus(
    model: OrthrusModel,
    path: str | Path,
    architecture: str = "OrthrusLM",
    model_type: str = "qwen3",
) -> Path:
    """Write ``model`` in the published Orthrus layout: config.json (Qwen3 keys plus
    ``block_size``, ``mask_token_id``, ``eos_token_id``), model.safetensors (AR names and
    ``*_diff`` names), generation_config.json, and the tokenizer files of its source."""
    from safetensors.torch import save_file

    if architecture not in ORTHRUS_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ORTHRUS_ARCHITECTURES}, "
                         f"got {architecture!r}")
    if model_type not in ("qwen3", "orthrus"):
        raise ValueError(f"model_type must be 'qwen3' or 'orthrus', got {model_type!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    lm = model.lm
    config = lm.config.to_dict()
    config.pop("_name_or_path", None)  # machine-local path of the source; not part of the layout
    eos = list(model.eos_token_ids)
    config.update(architectures=[architecture], model_type=model_type,
                  block_size=model.block_size, mask_token_id=model.mask_token_id,
                  eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in lm.state_dict().items()}
    if lm.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # safetensors writes 0600; checkpoints get shared
    lm.generation_config.save_pretrained(str(path))
    if model.source is not None:
        for name in _TOKENIZER_FILES:
            if (model.source / name).is_file() and model.source.resolve() != path.resolve():
                shutil.copyfile(model.source / name, path / name)
    return path
