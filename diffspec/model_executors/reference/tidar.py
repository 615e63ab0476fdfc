"""The quadratic view of a TiDAR or NLD checkpoint: one backbone that verifies (causal rows)
and drafts (mask branches) in one forward, under the structured mask of
:func:`diffspec.core.masks.quadratic_mask`. The decoding loop is
:mod:`diffspec.spec_workers.reference.tidar`.

Checkpoints (:func:`load_quadratic`): **TiDAR**, a stock transformers causal LM (Qwen3,
Qwen2.5 ...) whose ``config.json`` holds ``block_size`` (K) and ``mask_token_id``
(``dlm_type: "dream"`` marks shifted draft logits); **NLD** through
:func:`~diffspec.model_executors.reference.nld.load_nld` without its LoRA (NLD's quadratic
mode runs the plain backbone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
from diffspec.core.kv import rollback_kv
from diffspec.core.masks import quadratic_mask
from diffspec.model_executors.reference.views import block_view_logits

__all__ = ["QuadraticModel", "commit_kv", "load_quadratic", "quadratic_forward"]


@dataclass(eq=False)
class QuadraticModel:
    """One backbone that verifies (causal rows) and drafts (mask branches) in one forward."""

    lm: nn.Module  # causal LM with sdpa / eager attention (a custom 4-D mask is applied)
    block_size: int  # K: mask tokens per branch, as trained
    mask_token_id: int
    logits_shift: bool  # True: a mask at position p predicts p + 1; False: its own token
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size < 1 or (self.block_size < 2 and not self.logits_shift):
            raise ValueError(f"block_size={self.block_size} drafts nothing "
                             f"(logits_shift={self.logits_shift})")

    @property
    def config(self):
        return self.lm.config

    @property
    def max_draft_tokens(self) -> int:
        """Drafts one branch yields: ``K`` shifted, ``K - 1`` unshifted."""
        return self.block_size - 1 + int(self.logits_shift)


def load_quadratic(path: str | Path, dtype: torch.dtype = torch.float32) -> QuadraticModel:
    """Load a TiDAR checkpoint (a stock causal LM whose config names ``block_size`` and
    ``mask_token_id``) or an NLD checkpoint (its plain backbone) for quadratic decoding."""
    from transformers import AutoModelForCausalLM

    from diffspec.model_executors.reference.loading import from_pretrained_strict
    from diffspec.model_executors.reference.nld import load_nld

    info = inspect_checkpoint(path)
    if info.family == "nld":
        nld = load_nld(info.path, dtype, lora=False)
        return QuadraticModel(nld.lm, nld.block_size, nld.mask_token_id, nld.logits_shift,
                              nld.eos_token_ids)
    if info.family not in ("tidar", "qwen3", "refusion", None):
        raise CheckpointError(f"checkpoint {info.path} is family {info.family!r}; quadratic "
                              f"decoding needs an NLD checkpoint or a causal LM trained with "
                              f"the TiDAR recipe")
    missing = [k for k in ("block_size", "mask_token_id") if info.config.get(k) is None]
    if missing:
        raise CheckpointError(f"checkpoint {info.path} has no {' or '.join(missing)} in "
                              f"config.json; a TiDAR checkpoint names its block size and mask "
                              f"token there")
    if info.vocab_size is not None and not 0 <= int(info.config["mask_token_id"]) < info.vocab_size:
        raise CheckpointError(f"checkpoint {info.path} has mask_token_id="
                              f"{info.config['mask_token_id']} outside its vocabulary")
    lm = from_pretrained_strict(AutoModelForCausalLM, info.path, dtype=dtype)
    return QuadraticModel(lm, int(info.config["block_size"]), int(info.config["mask_token_id"]),
                          info.config.get("dlm_type") == "dream", info.eos_token_ids)


@torch.inference_mode()
def quadratic_forward(
    model: QuadraticModel,
    cache,  # DynamicCache with the KV of the P committed tokens before the anchor
    anchor: int,
    drafts: Sequence[int],  # [n] last step's drafts, for positions P+1 .. P+n
    num_masks: int,  # K' mask tokens per branch
) -> Tensor:  # [(n + 1) * (1 + K'), vocab] float32: verify rows, then branch 0 .. n
    """Draft and verify in one forward; the KV of every new token is left in ``cache``
    (:func:`commit_kv` keeps the accepted ones)."""
    prefix_len, n = cache.get_seq_length(), len(drafts)
    device = model.lm.device
    mask, positions = quadratic_mask(prefix_len, n, num_masks, device=device)
    ids = torch.tensor([anchor, *drafts] + [model.mask_token_id] * ((n + 1) * num_masks),
                       device=device)
    return block_view_logits(model.lm, ids, positions, cache, mask, keep_kv=True).float()


def commit_kv(cache, prefix_len: int, num_accepted: int) -> None:
    """Keep the KV of the verify tokens ``t_0 .. t_a`` (first in the layout) and evict the
    rest (rejected drafts, every branch) by moving the length."""
    rollback_kv(cache, prefix_len + num_accepted + 1)
