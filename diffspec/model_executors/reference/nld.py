"""Nemotron-Labs-Diffusion (NLD): one Ministral3 backbone, two attention modes, a LoRA drafter.

Design notes: docs/design/reference.md (section ``diffspec/model_executors/reference/nld.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint, require_method
from diffspec.model_executors.reference.loading import from_pretrained_strict
from diffspec.model_executors.reference.views import anchor_block, block_view_logits

__all__ = ["NLDModel", "load_nld"]

_KEY_MAPPING = {r"^encoder\.": "model.", r"^diffusion_head\.": "lm_head."}
_CONFIG_SKIP = ("model_type", "architectures", "auto_map", "transformers_version",
                "torch_dtype", "dtype")


@dataclass(eq=False)
class NLDModel:
    """An NLD checkpoint in memory: the causal ``lm`` (AR view and verifier), the optional
    draft LoRA, and the drafting settings from its config."""

    lm: nn.Module  # Ministral3ForCausalLM; adapter layers (if any) disabled outside drafting
    block_size: int
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    logits_shift: bool  # True only for dlm_type == "dream"
    peft: nn.Module | None = None  # the PeftModel holding the draft LoRA, or None
    source: Path | None = None

    @property
    def config(self):
        return self.lm.config

    @property
    def has_lora(self) -> bool:
        return self.peft is not None

    @contextlib.contextmanager
    def draft_view(self) -> Iterator[None]:
        """Turn the draft LoRA on for the duration of the block (a no-op without LoRA)."""
        if self.peft is None:
            yield
            return
        self.peft.base_model.enable_adapter_layers()
        try:
            yield
        finally:
            self.peft.base_model.disable_adapter_layers()

    def draft_logits(self, anchor: int, cache, num_drafts: int) -> Tensor:  # [num_drafts, vocab]
        """One bidirectional pass over ``[anchor, <mask> x num_drafts]`` on the prefix cache
        (LoRA on, block K/V not kept); the logits that predict the ``num_drafts`` drafts."""
        block, positions = anchor_block(anchor, self.mask_token_id, cache.get_seq_length(),
                                        num_drafts, self.lm.device)
        with self.draft_view():
            logits = block_view_logits(self.lm, block, positions, cache)  # [n + 1, vocab]
        return (logits[:-1] if self.logits_shift else logits[1:]).float()


def _ministral3_config(config: dict):
    from transformers import Ministral3Config

    return Ministral3Config(**{k: v for k, v in config.items() if k not in _CONFIG_SKIP})


def _attach_lora(lm: nn.Module, lora_path: Path, dtype: torch.dtype) -> nn.Module:
    """Inject the PEFT LoRA of ``lora_path`` into ``lm`` (disabled); return the PeftModel.

    The adapter was saved against NLD's module tree (``encoder.layers...``); ``lm`` is a
    ``Ministral3ForCausalLM`` (``model.layers...``), so the saved keys are renamed."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(lora_path))
    config.inference_mode = True
    peft_model = get_peft_model(lm, config)
    saved = load_file(str(lora_path / "adapter_model.safetensors"))
    renamed = {k.replace("base_model.model.encoder.", "base_model.model.model.", 1): v
               for k, v in saved.items()}
    result = set_peft_model_state_dict(peft_model, renamed)
    if result.unexpected_keys:
        raise CheckpointError(f"LoRA {lora_path} has tensors that match no module of the "
                              f"model, first {result.unexpected_keys[0]}")
    loaded = sum(".lora_A." in k for k in renamed)
    expected = sum(".lora_A." in n for n, _ in peft_model.named_parameters())
    if loaded != expected:
        raise CheckpointError(f"LoRA {lora_path} holds {loaded} lora_A tensors for {expected} "
                              f"adapted modules")
    peft_model.to(dtype).eval()
    peft_model.base_model.disable_adapter_layers()
    return peft_model


def load_nld(path: str | Path, dtype: torch.dtype = torch.float32, lora: bool = True) -> NLDModel:
    """Load an NLD checkpoint (``model_type`` ``nemotron_labs_diffusion``) without remote
    code. ``lora=True`` attaches ``linear_spec_lora/`` when the checkpoint has one (active
    only in the draft pass); ``lora=False`` drafts with the plain backbone."""
    from transformers import Ministral3ForCausalLM
    from transformers.utils import logging as hf_logging

    info = inspect_checkpoint(path)
    require_method(info, "linear_self_spec")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # rope_parameters' llama_4_scaling_beta is "unrecognized"
    try:
        config = _ministral3_config(info.config)
        lm = from_pretrained_strict(Ministral3ForCausalLM, info.path, config=config,
                                    dtype=dtype, key_mapping=_KEY_MAPPING)
    finally:
        hf_logging.set_verbosity(verbosity)
    lm.eval()
    peft_model = None
    if lora and info.lora_path is not None:
        peft_model = _attach_lora(lm, info.lora_path, dtype)
    assert info.mask_token_id is not None and info.block_size is not None  # require_method
    return NLDModel(lm, info.block_size, info.mask_token_id, info.eos_token_ids,
                    info.logits_shift, peft_model, info.path)


def load_ar_view(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The AR view of an NLD checkpoint: its causal backbone without the draft LoRA
    (registry ``Family.ar_view``)."""
    return load_nld(path, dtype=dtype, lora=False).lm
