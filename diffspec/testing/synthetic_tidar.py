"""A tiny TiDAR model: the bundled synth-qwen3 fine-tuned with the TiDAR recipe.

Design notes: docs/design/testing.md (section ``diffspec/testing/synthetic_tidar.py``).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffspec.testing import synthetic

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

    rows = [synthetic.packed_tokens(rng, vocab, cfg.seq_len + 1) for _ in range(cfg.batch_size)]
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

    cfg = TiDARTrainConfig(**overrides)
    vocab = synthetic.vocabulary_ids()
    mask_id = vocab[synthetic.MASK]
    rng = random.Random(cfg.seed)

    def loss_fn(model, rows):
        loss, ar, diffusion = tidar_loss(model, rows, mask_id, cfg)
        return {"loss": loss, "ar": ar, "diffusion": diffusion}

    config = {"mask_token_id": mask_id, "block_size": cfg.block_size,
              "dlm_type": "dream" if cfg.logits_shift else "llada"}
    base, result = synthetic.fine_tune_qwen3(
        out_dir, base, cfg, lambda: tidar_batch(rng, vocab, cfg), loss_fn, config,
        attn_implementation="sdpa")
    keys = ("loss", "ar", "diffusion")
    return synthetic.write_record(out_dir, {
        "command": command or f"python -m diffspec.testing.synthetic_tidar train --out {out_dir}",
        "base": base.name,
        "final_loss_mean_last_50": synthetic.tail_means(result.history, 50, keys),
        "first_loss": synthetic.tail_means(result.history[:1], 1, keys),
        "wall_time_s": round(result.wall_time_s, 1),
        "cpu_time_s": round(result.cpu_time_s, 1),
        "config": asdict(cfg),
        "torch": torch.__version__,
    })


# ---------------------------------------------------------------------------- evaluation


def evaluate(model_dir: str | Path, num_prompts: int, seed: int, max_tokens: int,
             temperature: float = 0.0, sampling_seed: int | None = None) -> dict[str, Any]:
    """Quadratic decoding of ``sample_prompts(num_prompts, seed)``: TPF, mean acceptance
    length, and whether the output equals plain AR decoding token for token."""
    import torch

    from diffspec.core.sampling import SamplingParams
    from diffspec.model_executors.reference.tidar import load_quadratic
    from diffspec.spec_workers.reference.decoder import ar_generate
    from diffspec.spec_workers.reference.tidar import tidar_generate

    torch.set_num_threads(1)
    model = load_quadratic(model_dir)
    params = SamplingParams(temperature=temperature, seed=sampling_seed)
    requests = synthetic.prompt_requests(num_prompts, seed, max_tokens, model.eos_token_ids,
                                         sampling=params)
    start = time.perf_counter()
    outs = tidar_generate(model, requests)
    wall = time.perf_counter() - start
    ar = ar_generate(model.lm, requests)
    steps = [k for o in outs for k in o.accept_lengths]
    return {
        "prompts": f"sample_prompts({num_prompts}, {seed})",
        "sampling": asdict(params),
        "max_tokens": max_tokens,
        "block_size": model.block_size,
        "drafts_per_step": model.max_draft_tokens,
        **synthetic.decode_summary(outs, wall),
        "mean_accept_length": round(sum(steps) / len(steps), 3),
        "equals_ar": all(o.token_ids == r.token_ids for o, r in zip(outs, ar)),
    }


def main(argv: list[str] | None = None) -> int:
    module = "diffspec.testing.synthetic_tidar"
    parser, sub, train = synthetic.trainer_cli(
        module, "fine-tune synth-qwen3 with the TiDAR recipe", TiDARTrainConfig)
    train.add_argument("--block-size", type=int, default=TiDARTrainConfig.block_size)
    ev = sub.add_parser("eval", help="TPF and acceptance of quadratic decoding vs AR")
    ev.add_argument("--model", default=str(SYNTH_TIDAR_DIR))
    synthetic.add_prompt_args(ev)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--sampling-seed", type=int, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        return synthetic.run_train(module, args, train_synthetic_tidar,
                                   ("out", "steps", "seed", "block_size"))
    print(json.dumps(evaluate(args.model, args.prompts, args.seed, args.max_tokens,
                              args.temperature, args.sampling_seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
