"""Orthrus head distillation: train the ``*_diff`` attention projections, nothing else.

Design notes: docs/design/training.md (section ``diffspec/train/orthrus.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from diffspec.model_executors.reference.views import block_view_logits
from diffspec.train import (
    FitResult,
    TrainConfig,
    TrainResult,
    fit,
    log_to_stderr,
    torch_threads,
    warn_slow_autocast,
)
from diffspec.train.data import (
    anchor_blocks,
    make_dataloader,
    narrow_blocks,
    sample_anchors,
    training_rows,
)
from diffspec.train.losses import Divergence, DraftLoss, accepted_prefix_weights, draft_loss

__all__ = [
    "BlockDistiller",
    "freeze_all_but",
    "train_orthrus",
]

Weighting = Literal["all", "accepted_prefix"]
ViewFactory = Callable[[], contextlib.AbstractContextManager]


class BlockDistiller(nn.Module):
    """Forward = one distillation step on clean rows; returns the loss terms (a dict of
    scalar tensors, ``"loss"`` to back-propagate).

    ``teacher_view`` / ``draft_view`` are context-manager factories that put ``lm`` in its
    AR view and its draft view (Orthrus: nothing / ``diffusion_view``; NLD: LoRA off / on).
    ``shifted``: draft position j predicts token j+1 (Orthrus) or token j (NLD, unshifted).
    ``weighting``: every block position, or each block's accepted prefix plus one.
    """

    def __init__(
        self,
        lm: nn.Module,
        *,
        block_size: int,
        mask_token_id: int,
        num_anchors: int,
        draft_view: ViewFactory,
        teacher_view: ViewFactory = contextlib.nullcontext,
        shifted: bool = True,
        weighting: Weighting = "all",
        divergence: Divergence = "kl",
        divergence_weight: float = 1.0,
        ce_weight: float = 0.0,
        ce_on_data: bool = True,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 2 or num_anchors < 1:
            raise ValueError(f"need block_size >= 2 and num_anchors >= 1, got {block_size}, "
                             f"{num_anchors}")
        self.lm = lm
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.num_anchors = num_anchors
        self.draft_view, self.teacher_view = draft_view, teacher_view
        self.shifted, self.weighting = shifted, weighting
        self.loss_kwargs = {"divergence": divergence, "divergence_weight": divergence_weight,
                            "ce_weight": ce_weight, "temperature": temperature}
        self.ce_on_data = ce_on_data
        # Under `accelerate launch` every process draws its own anchors.
        self.generator = torch.Generator().manual_seed(seed + int(os.environ.get("RANK", "0")))

    def forward(self, input_ids: Tensor) -> dict[str, Tensor]:  # input_ids: [B, L]
        batch, seq_len = input_ids.shape
        anchors = torch.stack([
            sample_anchors(seq_len, self.block_size, self.num_anchors, self.generator)
            for _ in range(batch)
        ]).to(input_ids.device)  # [B, n]
        teacher_logits, cache = self._teacher(input_ids)  # [B, L, V]
        blocks = anchor_blocks(input_ids, anchors, self.block_size, self.mask_token_id)
        with self.draft_view():
            logits = block_view_logits(self.lm, blocks.input_ids, blocks.position_ids, cache,
                                       blocks.attention_mask)  # [B, n*K, V]
        student = self._draft_rows(logits.view(batch, anchors.shape[1], self.block_size, -1))

        # Draft k (0 .. K-2) of the block at a predicts token a+k+1: teacher logits at a+k.
        offsets = torch.arange(self.block_size - 1, device=input_ids.device)
        positions = anchors[:, :, None] + offsets  # [B, n, K-1]
        teacher = _gather_positions(teacher_logits, positions)  # [B, n, K-1, V]
        targets = input_ids.gather(1, (positions + 1).flatten(1)) if self.ce_on_data else None
        return self._loss(student, teacher, targets).as_tensors()

    def _loss(
        self,
        student: Tensor,  # [B, n, K-1, V] draft logits
        teacher: Tensor,  # [B, n, K-1, V] AR logits for the same tokens
        targets: Tensor | None,  # [B, n*(K-1)] true next tokens, or None (teacher argmax)
    ) -> DraftLoss:
        weights = None
        if self.weighting == "accepted_prefix":
            weights = accepted_prefix_weights(student.detach().argmax(-1), teacher.argmax(-1))
            weights = weights.flatten()
        vocab = student.shape[-1]
        target_ids = None if targets is None else targets.flatten()
        return draft_loss(student.reshape(-1, vocab), teacher.reshape(-1, vocab),
                          weights=weights, target_ids=target_ids, **self.loss_kwargs)

    @torch.no_grad()
    def _teacher(self, input_ids: Tensor) -> tuple[Tensor, Any]:
        """AR view over the clean rows: logits [B, L, V] and the AR KV cache."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.config)
        with self.teacher_view():
            out = self.lm(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits.float(), cache

    def _draft_rows(self, logits: Tensor) -> Tensor:  # [B, n, K, V] -> [B, n, K-1, V]
        """The K-1 block rows that hold drafts: all but the last when shifted, all but the
        anchor's own row when not."""
        return logits[:, :, :-1] if self.shifted else logits[:, :, 1:]


def _gather_positions(logits: Tensor, positions: Tensor) -> Tensor:
    """``logits [B, L, V]`` at ``positions [B, ...]`` -> ``[B, ..., V]``."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    flat = positions.reshape(batch, -1)  # [B, P]
    picked = logits.gather(1, flat[:, :, None].expand(-1, -1, vocab))  # [B, P, V]
    return picked.view(*positions.shape, vocab)


def freeze_all_but(module: nn.Module, trainable: list[nn.Parameter]) -> None:
    """``requires_grad`` on exactly the parameters in ``trainable``."""
    keep = {id(p) for p in trainable}
    for p in module.parameters():
        p.requires_grad_(id(p) in keep)


# ------------------------------------------------------------------------------ trainer


def train_orthrus(
    base: str | Path,
    out_dir: str | Path | None,
    cfg: TrainConfig,
    *,
    data: list[str] | tuple[str, ...] = ("synthetic",),
    block_size: int = 16,
    mask_token_id: int | None = None,
    num_anchors: int = 8,
    ce_weight: float = 0.0,
    temperature: float = 1.0,
    rank: int | None = None,
    command: str | None = None,
) -> TrainResult:
    """Distill Orthrus diffusion heads onto ``base`` and save the checkpoint to ``out_dir``.

    ``base`` is a Qwen3 or Llama checkpoint (the ``*_diff`` weights start as copies of its
    AR projections) or an Orthrus checkpoint (training continues from its ``*_diff``
    weights; its ``block_size`` and mask token are kept). With ``rank`` (base checkpoints
    only) the heads are low-rank deltas and ``out_dir`` receives the heads folder
    (``heads.safetensors`` + ``heads.json``). ``data`` is ``["synthetic"]`` or text / JSONL
    files and folders, tokenized with the base's tokenizer.
    """
    from diffspec.core.checkpoint import resolve_checkpoint

    given, base = str(base), resolve_checkpoint(base)  # a folder, or a hub id in the cache
    torch.manual_seed(cfg.seed)
    model = _load_start(base, block_size, mask_token_id, rank, cfg.seed)
    freeze_all_but(model.lm, model.diffusion_parameters())
    rows = training_rows(base, data, cfg.seq_len, seed=cfg.seed,
                         eos_token_ids=model.eos_token_ids)
    distiller = BlockDistiller(
        model.lm, block_size=model.block_size, mask_token_id=model.mask_token_id,
        num_anchors=num_anchors, draft_view=model.diffusion_view, shifted=True,
        divergence="kl", ce_weight=ce_weight, temperature=temperature, seed=cfg.seed,
    )
    cfg.extra.update(method="orthrus", base=given, base_name=base.name,
                     data=list(data), block_size=model.block_size, num_anchors=num_anchors,
                     ce_weight=ce_weight, temperature=temperature, rank=rank)
    result = fit(distiller, make_dataloader(rows, cfg.batch_size), cfg)
    model.lm.eval()
    record = training_record(cfg, result, model.diffusion_parameters(), command)
    trained = result.trained_state(lambda name: "_diff." in name)  # every process calls it
    out = None
    if out_dir is not None and result.is_main_process:
        from diffspec.model_executors.reference.orthrus import save_orthrus, save_orthrus_heads

        if result.distributed:  # the in-memory model is sharded: rebuild it whole
            model = _load_start(base, block_size, mask_token_id, rank, cfg.seed)
            model.lm.load_state_dict({k.removeprefix("lm."): v for k, v in trained.items()},
                                     strict=False)
        # heads: the factors are rounded to bf16 in memory too, so `model` is what was saved
        out = save_orthrus(model, out_dir) if rank is None else save_orthrus_heads(model, out_dir)
        (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return TrainResult(model, out, record, result)


def _load_start(base: str | Path, block_size: int, mask_token_id: int | None,
                rank: int | None = None, seed: int = 0):
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.model_executors.reference.orthrus import load_orthrus, orthrus_from_base

    if inspect_checkpoint(base).family == "orthrus":
        if rank is not None:
            raise ValueError(f"--rank trains low-rank heads on a base AR checkpoint; {base} is "
                             f"already an Orthrus checkpoint (train it without --rank)")
        return load_orthrus(base)
    return orthrus_from_base(base, block_size=block_size, mask_token_id=mask_token_id,
                             rank=rank, seed=seed)


def _load_heads_start(base: Path, heads: str | Path, block_size: int,
                      mask_token_id: int | None, rank):
    """The heads folder ``heads`` on ``base``, to continue training; refuses settings that
    contradict the folder's (a different rank, block size or mask token would not be the
    same heads)."""
    from diffspec.model_executors.reference.orthrus import (
        load_orthrus_heads,
        read_heads_config,
    )

    record = read_heads_config(heads)
    for key, given in (("rank", rank), ("block_size", block_size),
                       ("mask_token_id", mask_token_id)):
        if given is not None and record[key] != given:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"pass {flag} {record[key]}: --init-heads {heads} has {key} "
                             f"{record[key]}, not {given}")
    return load_orthrus_heads(base, heads)


def training_record(
    cfg: TrainConfig, result: FitResult, trained: list[nn.Parameter], command: str | None
) -> dict[str, Any]:
    """What a checkpoint's ``training.json`` records: settings, loss curve summary, time."""
    losses = [h["loss"] for h in result.history]
    tail = losses[-20:]
    every = max(1, len(losses) // 20)
    return {
        "command": command,
        "config": cfg.as_dict(),
        "trainable_parameters": sum(p.numel() for p in trained),
        "first_loss": round(losses[0], 4),
        "final_loss_mean_last_20": round(sum(tail) / len(tail), 4),
        "loss_curve": [[i, round(losses[i], 4)] for i in range(0, len(losses), every)],
        "final_metrics": {k: round(v, 4) for k, v in result.history[-1].items()},
        "wall_time_s": round(result.wall_time_s, 1),
        "cpu_time_s": round(result.cpu_time_s, 1),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }



# --------------------------------------------------------------------------- measurement


def measure_orthrus(model) -> dict[str, dict[str, Any]]:
    """TPF / acceptance of :class:`~diffspec.spec_workers.reference.decoder.BlockDrafter` drafting
    ``block_size - 1`` tokens, greedy, on the synthetic prompt sets (synthetic-language
    models only; see :func:`diffspec.testing.synthetic.measure_on_synthetic`)."""
    from diffspec.spec_workers.reference.decoder import BlockDrafter
    from diffspec.testing.synthetic import measure_on_synthetic

    return measure_on_synthetic(model.lm, BlockDrafter(model), model.block_size - 1)


def write_training_md(out_dir: str | Path, record: dict[str, Any], title: str) -> Path:
    """``TRAINING.md``: the command, settings, loss curve summary, time and measured TPF."""
    cfg, extra = record["config"], record["config"]["extra"]
    rows = {
        "base": f"`{Path(extra['base']).name}` (AR weights unchanged, bit for bit)",
        "data": f"{', '.join(extra['data'])} (rows of {cfg['seq_len']} tokens, "
                f"{cfg['batch_size']} rows per step)",
        "block size / anchors per row": f"{extra['block_size']} / {extra['num_anchors']}",
        "loss": f"forward KL(AR view &#124;&#124; diffusion view), T={extra['temperature']}, "
                f"CE weight {extra['ce_weight']}",
        "trainable parameters": f"{record['trainable_parameters']:,} (`*_diff` only"
                                + (f", low-rank r={extra['rank']}: heads folder)"
                                   if extra.get("rank") else ")"),
        "seed / steps": f"{cfg['seed']} / {cfg['steps']}",
        "optimizer": f"AdamW lr {cfg['lr']} (warmup {cfg['warmup_steps']}, cosine to "
                     f"{cfg['min_lr_ratio']}x), betas {tuple(cfg['betas'])}, weight decay "
                     f"{cfg['weight_decay']}, clip {cfg['max_grad_norm']}",
        "loss: first step / mean of last 20":
            f"{record['first_loss']} / {record['final_loss_mean_last_20']}",
        "training time": f"{record['wall_time_s']} s wall, {record['cpu_time_s']} s CPU "
                         f"(1 thread; a shared machine, so wall > CPU)",
        "torch": record["torch"],
    }
    curve = ", ".join(f"{s}: {v}" for s, v in record["loss_curve"])
    lines = [f"# {title}", "", "Trained on CPU, deterministically (seeded, 1 thread), by:", "",
             f"    {record['command']}", "", "| field | value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in rows.items()), "",
             f"Loss curve (step: loss): {curve}", ""]
    if record.get("measured"):
        lines += _measured_section(record["measured"], extra["block_size"] - 1)
    lines.append("Full record: `training.json`.")
    path = Path(out_dir) / "TRAINING.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _measured_section(measured: dict[str, dict[str, Any]], num_drafts: int) -> list[str]:
    lines = [
        "## Measured", "",
        (f"Reference decoder (`speculative_generate` + `BlockDrafter`), greedy, {num_drafts} "
         "drafts per step, 64 new tokens per prompt, stop on `<|endoftext|>` / `<|im_end|>`. "
         "TPF = generated tokens / forwards (draft + verify = 2); acceptance length = tokens "
         "emitted per draft + verify step (accepted drafts + 1); `equal_ar`: every output "
         "equals plain AR decoding."), "",
        "| prompts | drafter | TPF | acceptance length | accepted drafts / step | equal_ar |",
        "|---|---|---|---|---|---|",
    ]
    for when, sets in measured.items():
        for name, m in sets.items():
            lines.append(f"| `{name}` | {when} | {m['tpf']} | {m['mean_accept_length']} | "
                         f"{m['mean_accepted_drafts']} | {m['equal_ar']} |")
    return [*lines, ""]


# ------------------------------------------------- answer rows: resumable, CPU-budgeted


def answer_anchors(
    length: int, prompt_len: int, block_size: int, num: int, generator: torch.Generator
) -> Tensor:  # [min(num, candidates)] int64, sorted
    """Distinct anchors whose drafts predict answer tokens: ``a`` in ``max(1, prompt_len -
    1) .. length - 2`` (the last prompt token anchors the first block of an answer, as at
    inference; every anchor has at least one draft inside the row). Empty when the row has
    no such position."""
    lo, hi = max(1, prompt_len - 1), length - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    picked = torch.randperm(hi - lo + 1, generator=generator)[:num] + lo
    return torch.sort(picked).values


def answer_positions(anchors: Tensor, block_size: int, length: int) -> tuple[Tensor, Tensor]:
    """Teacher positions ``a + j`` (draft ``j`` predicts token ``a + j + 1``) ``[n, K-1]``,
    clamped inside the row, and which of them have a target token in the row."""
    positions = anchors[:, None] + torch.arange(block_size - 1, device=anchors.device)
    valid = positions <= length - 2
    return positions.clamp(max=length - 1), valid


def chain_lengths(agree: Tensor) -> Tensor:  # [n, K-1] bool -> [n] int64
    """Leading drafts equal to the teacher's argmax: what a greedy verify accepts."""
    return torch.cumprod(agree.long(), dim=-1).sum(-1)


def orthrus_row_step(
    model,  # OrthrusModel (lm frozen but for the *_diff parameters)
    distiller: BlockDistiller,
    ids: Tensor,  # [1, T] one conversation row (prompt + answer)
    anchors: Tensor,  # [n] from answer_anchors
    normalizer: int,  # supervised positions in the whole batch (the loss is their mean)
    widths: Tensor | None = None,  # [n] each block's width (block_widths), None: K
    loss: Literal["kl", "ce"] = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """Loss (back-propagated by the caller) and metric sums of one row: forward KL from the
    AR view to the diffusion view at every valid draft position of every anchor block
    (with ``widths``, block ``b`` is ``[x_a, <mask> x (widths[b] - 1)]``: its drafts past
    the width are neither seen nor supervised, :func:`~diffspec.train.data.narrow_blocks`;
    the acceptance metrics count full-width blocks only). ``loss="ce"``: cross-entropy on
    the AR view's argmax instead (what greedy verification accepts); ``kl`` is reported
    either way."""
    length, block_size = ids.shape[1], model.block_size
    anchors = anchors.to(ids.device)
    teacher_logits, cache = distiller._teacher(ids)  # [1, T, V]
    blocks = anchor_blocks(ids, anchors[None], block_size, model.mask_token_id)
    if widths is not None:
        blocks = narrow_blocks(blocks, widths, length, block_size)
    with model.diffusion_view():
        logits = block_view_logits(model.lm, blocks.input_ids, blocks.position_ids, cache,
                                   blocks.attention_mask)  # [1, n*K, V]
    n, vocab = anchors.shape[0], logits.shape[-1]
    student = logits.view(n, block_size, vocab)[:, :-1]  # [n, K-1, V] shifted drafts
    positions, valid = answer_positions(anchors, block_size, length)
    if widths is not None:  # draft j of a width-w block exists for j < w - 1
        valid = valid & (torch.arange(block_size - 1, device=ids.device)[None, :]
                         < widths.to(ids.device)[:, None] - 1)
    teacher = teacher_logits[0, positions]  # [n, K-1, V]
    logq = torch.log_softmax(student[valid].float(), dim=-1)
    logp = torch.log_softmax(teacher[valid].float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum()
    objective = kl if loss == "kl" else -logq.gather(-1, logp.argmax(-1, keepdim=True)).sum()
    with torch.no_grad():
        agree = (student.argmax(-1) == teacher.argmax(-1)) & valid
        full = valid.all(-1)  # anchors whose whole (full-width) block lies in the row
        chains = chain_lengths(agree[full])
        sums = {"kl": float(kl), "count": int(valid.sum()), "right": int(agree.sum()),
                "anchors": int(full.sum()), "chain": int(chains.sum())}
        for j in range(block_size - 1):
            sums[f"accept_{j}"] = int((chains > j).sum())
    return objective / normalizer, sums


def _supervised(anchors: Tensor, widths: Tensor | None, block_size: int, length: int) -> int:
    """Draft positions :func:`orthrus_row_step` supervises for these anchors and widths."""
    valid = answer_positions(anchors, block_size, length)[1]
    if widths is not None:
        valid = valid & (torch.arange(block_size - 1)[None, :] < widths[:, None] - 1)
    return int(valid.sum())


def answer_metrics(sums: dict[str, float], block_size: int) -> dict[str, float]:
    """``kl`` / ``acc`` per supervised position; ``est_al``: 1 + mean accepted drafts of
    a full block (greedy, teacher-forced on the model's own answers); ``accept_j``: share of
    blocks whose first ``j + 1`` drafts are all accepted."""
    out: dict[str, float] = {}
    if sums.get("count"):
        out["kl"] = sums["kl"] / sums["count"]
        out["acc"] = sums["right"] / sums["count"]
    if sums.get("anchors"):
        out["est_al"] = 1 + sums["chain"] / sums["anchors"]
        for j in range(block_size - 1):
            out[f"accept_{j}"] = sums[f"accept_{j}"] / sums["anchors"]
    return out


def train_orthrus_answers(
    base: str | Path,
    out_dir: str | Path | None,
    cfg: TrainConfig,
    *,
    data: list[str] | tuple[str, ...],
    block_size: int = 8,
    mask_token_id: int | None = None,
    num_anchors: int = 64,
    rank: int | None = 64,
    init_heads: str | Path | None = None,
    block_widths: Sequence[int] | None = None,
    loss: Literal["kl", "ce"] = "kl",
    save_every: int = 25,
    snapshot_every: int = 0,
    max_cpu_s: float | None = None,
    resume: bool = False,
    max_rows: int | None = None,
    autocast_bf16: bool = False,
    device: str = "cpu",
    deadline: float | None = None,
    evaluate: Callable[[Any], dict[str, float]] | None = None,
    evaluate_every: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Orthrus heads distilled on whole conversation rows (JSONL ``token_ids`` +
    ``prompt_len``, e.g. :mod:`training.sharegpt` shards), anchors in the answers
    only, ``num_anchors`` blocks per row in one dual-pass forward (every block over the
    same AR cache), one row per forward (no padding), gradients accumulated over
    ``cfg.batch_size`` rows. Resumable (``out_dir/checkpoint/state.pt`` every
    ``save_every`` steps; ``resume`` continues it on the first session's data files), and
    stopped at ``max_cpu_s`` of CPU, all sessions together. Every ``snapshot_every``
    steps the heads are also copied to ``out_dir/snapshots/step-NNNNN`` (the curve of
    acceptance against training tokens is measured on those). ``autocast_bf16``: matmuls
    in bf16 (autocast; on CPU about twice as fast where it has AVX512-BF16 / AMX), the
    weights, optimizer and losses in fp32. ``device``: where the model trains (``"cuda"``
    on a GPU); checkpoints are written from CPU copies either way. ``deadline``: a
    ``time.monotonic()`` instant where the session stops and saves, like ``max_cpu_s``.
    ``evaluate(model) -> metrics`` (e.g. :func:`measure_answer_acceptance` on held-out
    rows) runs before the first step, every ``evaluate_every`` steps and at the end; its
    points (step, tokens seen, metrics) are the record's ``heldout_curve``. The steps run on
    :func:`diffspec.train.fit` (one row per forward, gradients accumulated over the
    batch). ``init_heads``: a heads folder (e.g. the shipped ones) to start from instead of
    ``B = 0``: training continues those heads in a new run (fresh optimizer and schedule;
    its rank, block size and mask token are the folder's, and the base must be the one
    they were trained against). ``block_widths``: each anchor's block drafts at a width
    drawn uniformly from these (each in ``2 .. K``; :func:`orthrus_row_step`), the shorter
    blocks the adaptive policy drafts at; None: every block at ``K``. ``loss``: forward
    KL to the AR view's distribution, or ``"ce"`` on its argmax."""
    from diffspec.core.checkpoint import resolve_checkpoint
    from diffspec.model_executors.reference.orthrus import save_orthrus, save_orthrus_heads
    from diffspec.train.data import StepBatches, data_files, files_sha256, load_rows
    from diffspec.train.runs import ResumableRun, write_json

    log = log or log_to_stderr
    given, base = str(base), resolve_checkpoint(base)
    run = ResumableRun.open(out_dir, resume=resume, max_cpu_s=max_cpu_s, command=command,
                            total_steps=cfg.steps, deadline=deadline)
    state = run.state
    block_size, mask_token_id, num_anchors, rank, autocast_bf16 = run.resumed(
        block_size=block_size, mask_token_id=mask_token_id, num_anchors=num_anchors, rank=rank,
        autocast_bf16=autocast_bf16)
    if state is not None:  # settings newer runs save (older states: the defaults)
        block_widths = state["settings"].get("block_widths")
        loss = state["settings"].get("loss", "kl")
    warn_slow_autocast(autocast_bf16, str(device), log)
    with torch_threads(cfg.num_threads):
        torch.manual_seed(cfg.seed)
        if init_heads is not None and state is None:
            model = _load_heads_start(base, init_heads, block_size, mask_token_id, rank)
        else:
            model = _load_start(base, block_size, mask_token_id, rank, cfg.seed)
        device = torch.device(device)
        model.lm.to(device)
        params = model.diffusion_parameters()
        freeze_all_but(model.lm, params)
        files = run.files(lambda: data_files(data))
        rows, data_stats = load_rows(None, cfg.seq_len, files=files, tokenizer_from=base)
        if max_rows is not None:
            rows = rows[:max_rows]
        if not rows:
            raise ValueError(f"no training rows in {list(data)}")
        data_info = {"sources": [str(d) for d in data], "files": [str(f) for f in files],
                     "files_sha256": files_sha256(files), **data_stats}
        run.check_rows(data_info["rows_sha256"])
        settings = {"block_size": model.block_size, "mask_token_id": model.mask_token_id,
                    "num_anchors": num_anchors, "rank": model.rank,
                    "autocast_bf16": autocast_bf16,
                    "block_widths": list(block_widths) if block_widths else None,
                    "loss": loss,
                    "init_heads": str(init_heads) if init_heads is not None else None}
        if block_widths and not all(2 <= w <= model.block_size for w in block_widths):
            raise ValueError(f"set --block-widths within 2..{model.block_size} (the block "
                             f"size), got {list(block_widths)}")
        width_choices = (torch.tensor(sorted(set(block_widths)), dtype=torch.long)
                         if block_widths else None)
        if state is not None:
            settings["init_heads"] = state["settings"].get("init_heads")
        rank = model.rank
        cfg.extra.update(method="orthrus", mode="answers", base=given, base_name=base.name,
                         data=list(data), **settings)
        distiller = BlockDistiller(model.lm, block_size=model.block_size,
                                   mask_token_id=model.mask_token_id, num_anchors=num_anchors,
                                   draft_view=model.diffusion_view, seed=cfg.seed)
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
        if state is not None:
            model.lm.load_state_dict(state["heads"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            distiller.generator.set_state(state["anchor_rng"])
            torch.set_rng_state(state["torch_rng"])
            log(f"resume: step {run.step} of {cfg.steps} from {run.state_path}")
        trainable = sum(p.numel() for p in params)
        log(f"orthrus (answers): base {base.name}, block {model.block_size}, "
            f"{num_anchors} anchors per row, rank {rank}, {trainable:,} trainable "
            f"parameters; {data_stats['rows']} rows, {data_stats['answer_tokens']:,} answer "
            f"tokens")
        out = Path(out_dir) if out_dir is not None else None

        def record() -> dict[str, Any]:
            tail = run.history[-20:]
            keys = [k for k in (tail[-1] if tail else {}) if k not in ("lr", "tokens_seen")]
            last = {k: round(sum(h[k] for h in tail if k in h)
                             / max(1, sum(k in h for h in tail)), 4) for k in keys}
            return {"method": "orthrus", "mode": "answers", "base": given,
                    "base_path": str(base), "command": command, "config": cfg.as_dict(),
                    "data": data_info, **run.counters(), "trainable_parameters": trainable,
                    "first_loss": run.history[0]["loss"] if run.history else None,
                    "final_metrics_mean_last_20": last,
                    "estimated_acceptance_length": last.get("est_al"),
                    "history": run.history, "heldout_curve": curve,
                    "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d")}

        curve: list[dict[str, Any]] = list(state.get("heldout_curve", [])) if state else []

        def measure() -> None:
            if evaluate is None or (curve and curve[-1]["step"] == run.step):
                return
            start = time.perf_counter()
            metrics = evaluate(model)
            model.lm.train()
            curve.append({"step": run.step, "tokens_seen": run.tokens_seen, **metrics,
                          "seconds": round(time.perf_counter() - start, 2)})
            log(f"held-out at step {run.step}: " + "  ".join(
                f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float)))

        def save(folder: Path, *, state_too: bool) -> None:
            if rank is None:
                save_orthrus(model, folder)
            else:
                save_orthrus_heads(model, folder, round_model=False)
            write_json(folder / "training.json", record())
            if state_too:
                run.save_state({
                    "heads": {n: p.detach().to("cpu", copy=True)
                              for n, p in model.lm.named_parameters() if "_diff." in n},
                    "optimizer": optimizer.state_dict(), "settings": settings,
                    "anchor_rng": distiller.generator.get_state(),
                    "data": {k: data_info[k] for k in ("files", "rows_sha256")},
                    "heldout_curve": curve, "config": cfg.as_dict()})

        def step_fn(lm, batch: list, backward) -> dict[str, float]:
            """One optimizer step's rows: one forward + backward per row (no padding),
            gradients accumulated; the loss is the mean over the batch's positions."""
            anchors = [answer_anchors(len(r.token_ids), r.prompt_len, model.block_size,
                                      num_anchors, distiller.generator) for r in batch]
            widths = [None if width_choices is None else width_choices[torch.randint(
                len(width_choices), (len(a),), generator=distiller.generator)]
                for a in anchors]
            normalizer = sum(int(_supervised(a, w, model.block_size, len(r.token_ids)))
                             for a, w, r in zip(anchors, widths, batch, strict=True))
            sums: dict[str, float] = {}
            loss = 0.0
            for r, a, w in zip(batch, anchors, widths, strict=True):
                if not len(a):
                    continue
                ids = torch.tensor(r.token_ids, dtype=torch.long, device=device)[None]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                    part, row_sums = orthrus_row_step(model, distiller, ids, a, normalizer, w,
                                                      loss)
                backward(part)
                loss += float(part.detach())
                for k, v in row_sums.items():
                    sums[k] = sums.get(k, 0) + v
            return {"loss": loss, **answer_metrics(sums, model.block_size)}

        def on_step(step: int, entry: dict[str, float]) -> bool:
            run.record_step(entry, sum(len(r.token_ids) for r in batches.last))
            done = step + 1
            if evaluate_every and done % evaluate_every == 0:
                measure()
            if out is not None and snapshot_every and done % snapshot_every == 0:
                save(out / "snapshots" / f"step-{done:05d}", state_too=False)
            if out is not None and save_every and done % save_every == 0 and done < cfg.steps:
                save(out, state_too=True)
            return run.stops_after(step, cfg.steps, log)

        def format_step(step: int, entry: dict[str, float]) -> str:
            return (f"step {step:5d}/{cfg.steps}  loss {entry['loss']:.4f}  acc "
                    f"{entry.get('acc', float('nan')):.3f}  est. AL "
                    f"{entry.get('est_al', float('nan')):.2f}  lr {entry['lr']:.2e}  "
                    f"{run.pace_note(cfg.steps)}")

        batches = StepBatches(rows, run.step, cfg.batch_size, cfg.seed, "diffspec.orthrus")
        if run.step == 0:
            measure()  # the untrained heads: the curve's first point
        run.start()
        fit(model.lm, batches, cfg, step_fn=step_fn, optimizer=optimizer,
            start_step=run.step, reseed=False, use_accelerate=False, on_step=on_step,
            format_step=format_step, log=log)
        measure()
        if out is not None:
            save(out, state_too=True)
        model.lm.eval()
        fit_result = FitResult(run.history, run.wall_time_s, run.cpu_time_s, model.lm)
        return TrainResult(model, out, record(), fit_result)


@torch.no_grad()
def measure_answer_acceptance(model, rows, *, max_anchors: int = 4096,
                              seed: int = 0) -> dict[str, float]:
    """Greedy acceptance of ``model``'s drafts on conversation rows (``diffspec.train.data.Row``,
    e.g. the model's own answers to held-out prompts), teacher-forced: every answer anchor
    (up to ``max_anchors`` per row) drafts a block over the AR cache of the row's prefix,
    and a draft counts as accepted while it equals the AR view's argmax, as a greedy verify
    decides on the model's own greedy text. Returns :func:`answer_metrics` (``est_al``,
    ``accept_j``, ``acc``, ``kl``) over all rows."""
    distiller = BlockDistiller(model.lm, block_size=model.block_size,
                               mask_token_id=model.mask_token_id, num_anchors=max_anchors,
                               draft_view=model.diffusion_view, seed=seed)
    model.lm.eval()
    device = next(model.lm.parameters()).device
    sums: dict[str, float] = {}
    for r in rows:
        anchors = answer_anchors(len(r.token_ids), r.prompt_len, model.block_size, max_anchors,
                                 distiller.generator)
        if not len(anchors):
            continue
        ids = torch.tensor(r.token_ids, dtype=torch.long, device=device)[None]
        _, row_sums = orthrus_row_step(model, distiller, ids, anchors, 1)
        for k, v in row_sums.items():
            sums[k] = sums.get(k, 0) + v
    return answer_metrics(sums, model.block_size)
