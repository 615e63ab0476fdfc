"""A tiny TiDAR model: the bundled synth-qwen3 fine-tuned with the TiDAR recipe.

TiDAR (Liu et al., "TiDAR: Think in Diffusion, Talk in Autoregression", arXiv 2511.08923)
trains one backbone in both modes at once, so that one forward can verify causally and
draft by one-step diffusion. Per row of ``L`` clean tokens ``x_0 .. x_{L-1}``:

* **input**: the clean stream, then a *fully masked copy* (``<|mask|> x L``); both halves
  sit at positions ``0 .. L-1``;
* **attention** (:func:`diffspec.core.masks.orthrus_dual_pass_mask` with the blocks tiling
  the copy, anchors ``0, K, 2K, ..``): the clean stream is causal and never sees the copy;
  the copy is cut into blocks of ``K``; a block's masks see the clean tokens before the
  block and every mask of their own block, never another block. At inference a branch of
  the quadratic layout (:mod:`diffspec.spec_workers.reference.tidar`) is exactly such a block: ``K``
  masks right after the last token they see;
* **loss**: ``(alpha * AR + diffusion) / (1 + alpha)``, ``alpha = 1``; AR = next-token
  cross-entropy on the clean stream, diffusion = cross-entropy on every mask (the full
  mask makes both terms cover the same ``L`` positions, the paper's reason for it). With
  ``logits_shift`` (default) the mask at position ``p`` predicts ``x_{p+1}``, so the ``K``
  masks of a branch give ``K`` drafts; without it a mask predicts ``x_p`` (LLaDA / NLD).

What is ours, not the paper's: the scale (2 layers, 371k parameters, from the bundled AR
model rather than Qwen2.5 1.5B / Qwen3 8B), the data (the synthetic language of
:mod:`diffspec.testing.synthetic`), the schedule, and where the paper leaves it open, the
exact block alignment (here blocks tile the row from position 0).

The saved checkpoint is a stock ``Qwen3ForCausalLM`` whose ``config.json`` adds
``block_size``, ``mask_token_id`` and ``dlm_type`` (``"dream"`` = shifted draft logits), the
layout :func:`diffspec.model_executors.reference.tidar.load_quadratic` reads.

CLI::

    python -m diffspec.testing.synthetic_tidar train --out DIR [--steps N --seed S --block-size K]
    python -m diffspec.testing.synthetic_tidar eval --model DIR [--prompts 16 --seed 1]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffspec.testing.synthetic import MASK, _sample_document, vocabulary

__all__ = ["SYNTH_TIDAR_DIR", "TiDARTrainConfig", "evaluate", "tidar_batch", "tidar_loss",
           "train_synthetic_tidar"]

from diffspec.assets import SYNTH_TIDAR_DIR


@dataclass(frozen=True)
class TiDARTrainConfig:
    steps: int = 1200
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128  # L clean tokens per row (the input is 2L with the masked copy)
    block_size: int = 8  # K
    logits_shift: bool = True
    alpha: float = 1.0  # AR loss weight, as the paper's default
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.seq_len % self.block_size:
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of "
                             f"block_size={self.block_size} (the blocks tile the masked copy)")


def tidar_batch(rng: random.Random, vocab: dict[str, int], cfg: TiDARTrainConfig):
    """``[batch, L + 1]`` rows of packed synthetic documents (each starts at a document
    start); the extra token is the last position's next-token label."""
    import torch

    rows = []
    for _ in range(cfg.batch_size):
        row: list[int] = []
        while len(row) < cfg.seq_len + 1:
            row += [vocab[w] for w in _sample_document(rng)]
        rows.append(row[: cfg.seq_len + 1])
    return torch.tensor(rows)  # [batch, L + 1]


def tidar_loss(model, rows, mask_id: int, cfg: TiDARTrainConfig):
    """The TiDAR loss of ``rows`` ``[batch, L + 1]``: ``(total, ar, diffusion)``."""
    import torch
    import torch.nn.functional as F

    from diffspec.core.masks import orthrus_dual_pass_mask
    from diffspec.model_executors.reference.views import block_view_logits

    length, k = cfg.seq_len, cfg.block_size
    clean = rows[:, :length]  # [batch, L]
    ids = torch.cat([clean, torch.full_like(clean, mask_id)], dim=1)  # [batch, 2L]
    mask, positions = orthrus_dual_pass_mask(length, range(0, length, k), k)  # [2L, 2L], [2L]
    logits = block_view_logits(model, ids, positions, None, mask).float()  # [batch, 2L, vocab]
    next_tokens = rows[:, 1:]  # [batch, L]
    ar = F.cross_entropy(logits[:, :length].transpose(1, 2), next_tokens)
    diffusion_labels = next_tokens if cfg.logits_shift else clean
    diffusion = F.cross_entropy(logits[:, length:].transpose(1, 2), diffusion_labels)
    return (cfg.alpha * ar + diffusion) / (1 + cfg.alpha), ar, diffusion


def train_synthetic_tidar(
    out_dir: str | Path, base: str | Path | None = None, command: str | None = None, **overrides
) -> dict[str, Any]:
    """Fine-tune ``base`` (default: the bundled synth-qwen3) with the TiDAR recipe and save
    a TiDAR-layout checkpoint (stock Qwen3 + ``block_size``, ``mask_token_id``, ``dlm_type``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR

    cfg = TiDARTrainConfig(**overrides)
    base = Path(base or SYNTH_QWEN3_DIR)
    out = Path(out_dir)
    vocab = {t: i for i, t in enumerate(vocabulary())}
    mask_id = vocab[MASK]
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM.from_pretrained(str(base), dtype=torch.float32,
                                                 attn_implementation="sdpa").train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                weight_decay=cfg.weight_decay)
        rng = random.Random(cfg.seed)
        log: list[dict[str, float]] = []
        start, cpu = time.perf_counter(), time.process_time()
        for step in range(cfg.steps):
            warm = (step + 1) / cfg.warmup
            decay = 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            for group in opt.param_groups:
                group["lr"] = cfg.lr * min(warm, decay)
            loss, ar, diffusion = tidar_loss(model, tidar_batch(rng, vocab, cfg), mask_id, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            log.append({"loss": loss.item(), "ar": ar.item(), "diffusion": diffusion.item()})
            if step % 50 == 0 or step == cfg.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.3f}  ar {ar.item():.3f}  "
                      f"diffusion {diffusion.item():.3f}", file=sys.stderr, flush=True)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        torch.set_num_threads(threads)

    model.eval()
    model.config.mask_token_id = mask_id
    model.config.block_size = cfg.block_size
    model.config.dlm_type = "dream" if cfg.logits_shift else "llada"
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, out / name)
    tail = log[-50:]
    record = {
        "command": command or f"python -m diffspec.testing.synthetic_tidar train --out {out}",
        "base": base.name,
        "final_loss_mean_last_50": {k: round(sum(r[k] for r in tail) / len(tail), 4)
                                    for k in ("loss", "ar", "diffusion")},
        "first_loss": {k: round(v, 4) for k, v in log[0].items()},
        "wall_time_s": round(wall, 1),
        "cpu_time_s": round(cpu, 1),
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ---------------------------------------------------------------------------- evaluation


def evaluate(model_dir: str | Path, num_prompts: int, seed: int, max_tokens: int,
             temperature: float = 0.0, sampling_seed: int | None = None) -> dict[str, Any]:
    """Quadratic decoding of ``sample_prompts(num_prompts, seed)``: TPF, mean acceptance
    length, and whether the output equals plain AR decoding token for token."""
    import torch

    from diffspec.spec_workers.reference.decoder import Request, ar_generate
    from diffspec.core.sampling import SamplingParams
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.spec_workers.reference.tidar import tidar_generate
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    torch.set_num_threads(1)
    model = load_quadratic(model_dir)
    tok = build_tokenizer()
    params = SamplingParams(temperature=temperature, seed=sampling_seed)
    requests = [Request(tok(p)["input_ids"], max_tokens=max_tokens, sampling=params,
                        stop_token_ids=model.eos_token_ids)
                for p in sample_prompts(num_prompts, seed)]
    start = time.perf_counter()
    outs = tidar_generate(model, requests)
    wall = time.perf_counter() - start
    ar = ar_generate(model.lm, requests)
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.num_forwards for o in outs)
    steps = [k for o in outs for k in o.accept_lengths]
    return {
        "prompts": f"sample_prompts({num_prompts}, {seed})",
        "sampling": asdict(params),
        "max_tokens": max_tokens,
        "block_size": model.block_size,
        "drafts_per_step": model.max_draft_tokens,
        "tokens": tokens,
        "forwards": forwards,
        "tpf": round(tokens / forwards, 3),
        "mean_accept_length": round(sum(steps) / len(steps), 3),
        "draft_acceptance": round(sum(o.num_accepted_tokens for o in outs)
                                  / max(1, sum(o.num_draft_tokens for o in outs)), 3),
        "equals_ar": all(o.token_ids == r.token_ids for o, r in zip(outs, ar)),
        "stopped": sum(o.finish_reason == "stop" for o in outs),
        "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffspec.testing.synthetic_tidar")
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="fine-tune synth-qwen3 with the TiDAR recipe")
    train.add_argument("--out", required=True)
    train.add_argument("--steps", type=int, default=TiDARTrainConfig.steps)
    train.add_argument("--seed", type=int, default=TiDARTrainConfig.seed)
    train.add_argument("--block-size", type=int, default=TiDARTrainConfig.block_size)
    ev = sub.add_parser("eval", help="TPF and acceptance of quadratic decoding vs AR")
    ev.add_argument("--model", default=str(SYNTH_TIDAR_DIR))
    ev.add_argument("--prompts", type=int, default=16)
    ev.add_argument("--seed", type=int, default=1)
    ev.add_argument("--max-tokens", type=int, default=64)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--sampling-seed", type=int, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        cmd = (f"python -m diffspec.testing.synthetic_tidar train --out {args.out} "
               f"--steps {args.steps} --seed {args.seed} --block-size {args.block_size}")
        record = train_synthetic_tidar(args.out, steps=args.steps, seed=args.seed,
                                       block_size=args.block_size, command=cmd)
        print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2))
    else:
        print(json.dumps(evaluate(args.model, args.prompts, args.seed, args.max_tokens,
                                  args.temperature, args.sampling_seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
