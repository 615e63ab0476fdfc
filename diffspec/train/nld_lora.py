"""NLD linear self-speculation: train the draft LoRA (``linear_spec_lora/``), nothing else.

Design notes: docs/design/training.md (section ``diffspec/train/nld_lora.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from diffspec.train import TrainConfig, TrainResult, fit
from diffspec.train.data import PackedRows, load_tokenizer, make_dataloader, training_rows
from diffspec.train.losses import Divergence
from diffspec.train.orthrus import BlockDistiller, freeze_all_but, training_record

__all__ = [
    "add_draft_lora",
    "fit_nld_base",
    "greedy_rows",
    "lora_parameters",
    "save_linear_spec_lora",
    "train_nld_lora",
    "train_tiny_nld_base",
]

LORA_DIR = "linear_spec_lora"
# PEFT keys as published (NLD's module tree) and as loaded here (Ministral3ForCausalLM).
_NLD_PREFIX, _HF_PREFIX = "base_model.model.encoder.", "base_model.model.model."


def add_draft_lora(nld, rank: int, alpha: int, *, dropout: float = 0.0):
    """``nld`` with a fresh LoRA on ``o_proj`` (PEFT's init: B = 0, so the draft pass starts
    exactly as the plain backbone), disabled outside :meth:`NLDModel.draft_view`. A model
    that already has a LoRA is returned as is (training continues from it)."""
    from peft import LoraConfig, get_peft_model

    if nld.peft is not None:
        return nld
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=["o_proj"],
                        lora_dropout=dropout)
    peft_model = get_peft_model(nld.lm, config)
    peft_model.base_model.disable_adapter_layers()
    return dataclasses.replace(nld, peft=peft_model)


def lora_parameters(nld) -> list[nn.Parameter]:
    """The LoRA parameters (what this trainer updates)."""
    return [p for n, p in nld.lm.named_parameters() if ".lora_" in n]


def trainable_draft_view(nld, params: list[nn.Parameter]):
    """``nld.draft_view`` for training: PEFT's adapter toggles also set ``requires_grad``
    (off when the adapters are disabled), so it is set back on for the LoRA parameters
    after each toggle; the backward pass runs after the view has closed."""

    @contextlib.contextmanager
    def view() -> Iterator[None]:
        try:
            with nld.draft_view():
                _set_requires_grad(params, True)
                yield
        finally:
            _set_requires_grad(params, True)

    return view


def _set_requires_grad(params: list[nn.Parameter], flag: bool) -> None:
    for p in params:
        p.requires_grad_(flag)


def save_linear_spec_lora(nld, folder: str | Path) -> Path:
    """Write the LoRA as NLD ships it: ``adapter_config.json`` + ``adapter_model.safetensors``
    (PEFT format, keys under NLD's module names ``base_model.model.encoder.*``), which
    :func:`~diffspec.model_executors.reference.nld.load_nld` and ``PeftModel.from_pretrained`` on the
    original NLD model both read."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(nld.peft)
    renamed = {k.replace(_HF_PREFIX, _NLD_PREFIX, 1): v.detach().contiguous()
               for k, v in state.items()}
    save_file(renamed, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(nld.peft.peft_config["default"])
    config.inference_mode = True
    config.base_model_name_or_path = None
    config.save_pretrained(str(folder))
    return folder


def export_checkpoint(nld, base: str | Path, out_dir: str | Path) -> Path:
    """``out_dir`` = the base checkpoint (weights hard-linked when possible, else copied)
    plus the trained ``linear_spec_lora/``. ``out_dir`` must not be ``base``."""
    base, out = Path(base), Path(out_dir)
    if out.resolve() == base.resolve():
        raise ValueError("out_dir must differ from the base checkpoint (it is never modified)")
    out.mkdir(parents=True, exist_ok=True)
    for file in base.iterdir():
        if file.is_file():
            _link_or_copy(file, out / file.name)
    save_linear_spec_lora(nld, out / LORA_DIR)
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ------------------------------------------------------------------------ self-generated rows


@torch.no_grad()
def greedy_rows(
    lm: nn.Module,
    rows: Iterator[Tensor],  # [L] int64 data rows; their first `prefix_len` tokens are kept
    prefix_len: int,
    batch_size: int,
) -> Iterator[Tensor]:  # [L] int64: prefix + the AR model's greedy continuation
    """Rows whose continuation after ``prefix_len`` data tokens is the model's own greedy
    output (AR view), so that the teacher's argmax at every later position is the next
    token of the row: exactly what a greedy verify compares drafts against."""
    from transformers import DynamicCache

    while True:
        batch = [row for row, _ in zip(rows, range(batch_size), strict=False)]
        if len(batch) < batch_size:
            return
        ids = torch.stack(batch)  # [B, L]
        seq_len = ids.shape[1]
        cache = DynamicCache(config=lm.config)
        out = ids[:, :prefix_len]
        logits = lm(input_ids=out, past_key_values=cache, use_cache=True).logits[:, -1]
        while out.shape[1] < seq_len:
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
            out = torch.cat([out, token], dim=1)
            logits = lm(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
        yield from out


class _GreedyRows(torch.utils.data.IterableDataset):
    def __init__(self, lm: nn.Module, rows: PackedRows, prefix_len: int, batch_size: int):
        super().__init__()
        self.lm, self.rows, self.prefix_len, self.batch_size = lm, rows, prefix_len, batch_size

    def __iter__(self) -> Iterator[Tensor]:
        return greedy_rows(self.lm, iter(self.rows), self.prefix_len, self.batch_size)


# ------------------------------------------------------------------------------ trainer


def train_nld_lora(
    base: str | Path,
    out_dir: str | Path | None,
    cfg: TrainConfig,
    *,
    data: list[str] | tuple[str, ...] = ("synthetic",),
    rank: int = 16,
    alpha: int = 64,
    num_anchors: int = 8,
    divergence: Divergence = "lk",
    ce_weight: float = 1.0,
    self_generate_prefix: int | None = None,
    fresh_lora: bool = True,
    command: str | None = None,
) -> TrainResult:
    """Train the draft LoRA of the NLD checkpoint ``base``; save the checkpoint plus
    ``linear_spec_lora/`` to ``out_dir``.

    ``fresh_lora`` ignores a LoRA the checkpoint already has and starts a new one
    (rank / alpha); otherwise training continues from the shipped one.
    ``self_generate_prefix``: replace each row after that many tokens by the model's own
    greedy continuation (the recommended data for a lossless greedy drafter).
    """
    from diffspec.core.checkpoint import resolve_checkpoint
    from diffspec.model_executors.reference.nld import load_nld

    if self_generate_prefix is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("self-generated rows are made by the main process's data loader, "
                         "which cannot run a sharded model: generate them offline and pass "
                         "them as JSONL token_ids under accelerate launch")
    given, base = str(base), resolve_checkpoint(base)
    torch.manual_seed(cfg.seed)
    nld = add_draft_lora(load_nld(base, lora=not fresh_lora), rank, alpha)
    lora_config = nld.peft.peft_config["default"]
    rank, alpha = lora_config.r, lora_config.lora_alpha  # the shipped LoRA's, if kept
    params = lora_parameters(nld)
    freeze_all_but(nld.lm, params)
    distiller = BlockDistiller(
        nld.lm, block_size=nld.block_size, mask_token_id=nld.mask_token_id,
        num_anchors=num_anchors, draft_view=trainable_draft_view(nld, params),
        shifted=nld.logits_shift, weighting="accepted_prefix", divergence=divergence,
        ce_weight=ce_weight, ce_on_data=False, seed=cfg.seed,
    )
    cfg.extra.update(method="nld-lora", base=given, data=list(data), rank=rank,
                     alpha=alpha, block_size=nld.block_size, num_anchors=num_anchors,
                     divergence=divergence, ce_weight=ce_weight,
                     self_generate_prefix=self_generate_prefix, fresh_lora=fresh_lora)
    rows = _training_rows(nld, base, data, cfg, self_generate_prefix)
    result = fit(distiller, make_dataloader(rows, cfg.batch_size), cfg)
    nld.peft.eval()
    nld.peft.base_model.disable_adapter_layers()
    record = training_record(cfg, result, params, command)
    trained = result.trained_state(lambda name: ".lora_" in name)  # every process calls it
    out = None
    if out_dir is not None and result.is_main_process:
        if result.distributed:  # the in-memory model is sharded: rebuild it whole
            nld = add_draft_lora(load_nld(base, lora=not fresh_lora), rank, alpha)
            nld.lm.load_state_dict({k.removeprefix("lm."): v for k, v in trained.items()},
                                   strict=False)
        out = export_checkpoint(nld, base, out_dir)
        (out / LORA_DIR / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return TrainResult(nld, out, record, result)


def _training_rows(nld, base: Path, data, cfg: TrainConfig, self_generate_prefix: int | None):
    """Data rows, or self-generated rows (data prefix + the model's greedy continuation)."""
    rows = training_rows(base, data, cfg.seq_len, seed=cfg.seed,
                         eos_token_ids=nld.eos_token_ids)
    if self_generate_prefix is None:
        return rows
    return _GreedyRows(nld.lm, rows, self_generate_prefix, cfg.batch_size)


# ------------------------------------------------------------- a tiny NLD base (tests, demos)


def synthetic_nld_words() -> list[str]:
    """The synthetic language's words for an NLD tokenizer: the chat markers as plain words,
    then the role words and the language's words (``<|endoftext|>`` becomes ``</s>``)."""
    from diffspec.testing.synthetic import IM_END, IM_START, ROLE_WORDS, language

    return [IM_START, IM_END, *ROLE_WORDS, *language().words]


def synthetic_nld_text(document: str) -> str:
    """A synthetic document in the NLD tokenizer's terms (its EOS is ``</s>``)."""
    from diffspec.testing.synthetic import ENDOFTEXT

    return document.replace(ENDOFTEXT, "</s>")


def train_tiny_nld_base(
    out_dir: str | Path,
    *,
    steps: int = 600,
    seed: int = 0,
    block_size: int = 16,
    batch_size: int = 16,
    seq_len: int = 192,
    lr: float = 3e-3,
    diffusion_weight: float = 1.0,
    log_every: int = 50,
) -> dict[str, Any]:
    """Train a small NLD (Ministral3, 2 layers, hidden 128) from scratch on the synthetic
    language and save it in the NLD layout (``encoder.*``, ``diffusion_head.weight``, no
    LoRA). Loss per step = AR CE (causal) + ``diffusion_weight`` x block-diffusion CE: rows
    ``[x_t, x_0]`` under :func:`~diffspec.core.masks.block_diffusion_training_mask`, each
    block of ``x_t`` masked with its own ratio t ~ U(0, 1), CE on the masked tokens
    (unshifted, as NLD predicts). A test-scale recipe, not NVIDIA's."""
    from diffspec.testing.checkpoints import write_nld

    out = Path(out_dir)
    words = synthetic_nld_words()
    write_nld(out, with_lora=False, block_size=block_size, seed=seed, words=words,
              vocab_size=16 * ((len(words) + 16 + 15) // 16), hidden_size=128,
              intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    cfg = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, seq_len=seq_len, seed=seed,
                      log_every=log_every, warmup_steps=30, weight_decay=0.01)
    _, record = fit_nld_base(out, cfg, block_size, diffusion_weight, synthetic_nld_text)
    record["recipe"] = f"AR CE + {diffusion_weight} x block-diffusion CE (block {block_size})"
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def fit_nld_base(out: Path, cfg: TrainConfig, block_size: int, diffusion_weight: float,
                 text: Callable[[str], str] = str) -> tuple[TrainResult, dict[str, Any]]:
    """Train every weight of the NLD checkpoint at ``out`` (written without a LoRA) under
    ``cfg`` on the synthetic documents (each through ``text`` before the checkpoint's
    tokenizer; default: as they are) with :class:`_BaseStep`'s AR CE + ``diffusion_weight`` x block-diffusion CE;
    save ``model.safetensors`` in the NLD layout. Returns the fit's result and its
    training record."""
    from safetensors.torch import save_file

    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.train.data import synthetic_documents

    torch.manual_seed(cfg.seed)
    nld = load_nld(out, lora=False)
    tokenizer = load_tokenizer(out)

    def docs() -> Iterator[list[int]]:
        for doc in synthetic_documents(cfg.seed):
            yield tokenizer(text(doc), add_special_tokens=False)["input_ids"]

    step = _BaseStep(nld.lm, block_size, nld.mask_token_id, diffusion_weight, cfg.seed)
    for p in nld.lm.parameters():
        p.requires_grad_(True)
    result = fit(step, make_dataloader(PackedRows(docs, cfg.seq_len), cfg.batch_size), cfg)
    tensors = {_nld_name(k): v.detach().contiguous() for k, v in nld.lm.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return result, training_record(cfg, result, list(nld.lm.parameters()), None)


def _nld_name(hf_name: str) -> str:
    if hf_name.startswith("lm_head."):
        return "diffusion_head." + hf_name[len("lm_head."):]
    return "encoder." + hf_name[len("model."):]


class _BaseStep(nn.Module):
    """AR CE + block-diffusion CE on clean rows (the tiny NLD base's objective)."""

    def __init__(self, lm: nn.Module, block_size: int, mask_token_id: int,
                 diffusion_weight: float, seed: int) -> None:
        super().__init__()
        self.lm, self.block_size, self.mask_token_id = lm, block_size, mask_token_id
        self.diffusion_weight = diffusion_weight
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, input_ids: Tensor) -> dict[str, Tensor]:  # input_ids: [B, L]
        from diffspec.core.masks import block_diffusion_training_mask
        from diffspec.model_executors.reference.views import block_view_logits

        ar = self.lm(input_ids=input_ids, labels=input_ids).loss
        batch, seq_len = input_ids.shape
        noisy, masked = self._noise(input_ids)  # [B, L], [B, L] bool
        mask, positions = block_diffusion_training_mask(seq_len, self.block_size)
        logits = block_view_logits(self.lm, torch.cat([noisy, input_ids], dim=1),
                                   positions.expand(batch, -1), None,
                                   mask.expand(batch, -1, -1))[:, :seq_len]  # [B, L, V]
        diff = nn.functional.cross_entropy(logits[masked].float(), input_ids[masked])
        loss = ar + self.diffusion_weight * diff
        return {"loss": loss, "ar_ce": ar.detach(), "diffusion_ce": diff.detach()}

    def _noise(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        batch, seq_len = input_ids.shape
        num_blocks = -(-seq_len // self.block_size)
        ratio = torch.rand(batch, num_blocks, 1, generator=self.generator)
        ratio = ratio.expand(-1, -1, self.block_size).reshape(batch, -1)[:, :seq_len]
        masked = torch.rand(batch, seq_len, generator=self.generator) < ratio
        masked[:, 0] |= ~masked.any(1)  # at least one masked token per row
        return input_ids.masked_fill(masked, self.mask_token_id), masked


def measure_nld_lora(nld, **prompt_kwargs: Any) -> dict[str, dict[str, Any]]:
    """TPF / acceptance of linear self-speculation on the synthetic prompts, drafting with
    the plain backbone (``without_lora``) and with the trained LoRA (``with_lora``). For an
    NLD trained on the synthetic language (:func:`train_tiny_nld_base`)."""
    from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
    from diffspec.testing.synthetic import measure_on_synthetic

    tokenizer = load_tokenizer(nld.source) if nld.source is not None else None
    prompt_kwargs.setdefault("text", synthetic_nld_text)
    report = {}
    for name, model in (("without_lora", dataclasses.replace(nld, peft=None)),
                        ("with_lora", nld)):
        report[name] = measure_on_synthetic(model.lm, LinearSelfSpecDrafter(model),
                                            nld.block_size - 1, tokenizer, **prompt_kwargs)
    return report
