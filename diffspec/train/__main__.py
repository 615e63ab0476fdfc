"""``python -m diffspec.train {orthrus,nld-lora,nld-base} ...``: train a drafter.

The EAGLE-3 baseline trainer is not part of the package: ``python -m training.eagle3``
from a checkout of the repository.

Runs as one plain process (CPU or one GPU) or under ``accelerate launch`` (DDP / FSDP);
see ``diffspec/train/README.md`` for real-model commands.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from diffspec.train import TrainConfig, rank_arg

EXAMPLES = """examples (tiny, CPU, a few minutes):
  python -m diffspec.train orthrus --base diffspec/assets/synth-qwen3 --out /tmp/synth-orthrus \\
      --block-size 32 --steps 1200 --measure
  python -m diffspec.train nld-base --out /tmp/synth-nld --steps 600
  python -m diffspec.train nld-lora --base /tmp/synth-nld --out /tmp/synth-nld-lora \\
      --self-generate-prefix 24 --steps 400 --measure

real models (GPU; see diffspec/train/README.md for FSDP):
  accelerate launch --config_file fsdp.yaml -m diffspec.train orthrus --base Qwen/Qwen3-8B \\
      --mask-token-id 151669 --out ckpt/orthrus-qwen3-8b --data responses.jsonl \\
      --block-size 32 --seq-len 2048 --num-anchors 64 --batch-size 1 --lr 2e-4 \\
      --steps 20000 --num-threads 0
"""


def _widths(text: str) -> list[int]:
    """``--block-widths 2,4,8``: block widths, each a whole number >= 2."""
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        widths = []
    if not widths or min(widths) < 2:
        raise argparse.ArgumentTypeError(f"give block widths as whole numbers >= 2 joined "
                                         f"by commas (e.g. 2,4,8), got {text!r}")
    return widths


def _add_train_args(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    g = p.add_argument_group("optimization (shared by every trainer)")
    g.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    g.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    g.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio,
                   help="the cosine schedule decays to lr * this")
    g.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    g.add_argument("--max-grad-norm", type=float, default=defaults.max_grad_norm,
                   help="gradient clipping (0 disables)")
    g.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help="rows per step and process")
    g.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per row")
    g.add_argument("--seed", type=int, default=defaults.seed,
                   help="seeds weights init, data order and anchors (deterministic on CPU)")
    g.add_argument("--num-threads", type=int, default=1,
                   help="torch CPU threads (default 1, reproducible; 0 = torch's default)")
    g.add_argument("--log-every", type=int, default=defaults.log_every)
    g.add_argument("--autocast-bf16", action="store_true",
                   help="CPU autocast to bf16 for the matmuls (about 2x faster on CPUs with "
                        "AVX512-BF16 / AMX; weights, optimizer and losses stay fp32); "
                        "orthrus --answers-only and training.eagle3")


def _add_run_args(p, what: str, *, save_every: int) -> None:
    """Options of a resumable, CPU-budgeted run (``diffspec.train.runs``)."""
    p.add_argument("--save-every", type=int, default=save_every,
                   help=f"write {what} and the resumable state (OUT/checkpoint/) every N steps")
    p.add_argument("--max-cpu-minutes", type=float,
                   help="stop (and save) once the run's CPU time, all sessions together, "
                        "reaches this; set --steps so that the schedule ends near it")
    p.add_argument("--max-wall-minutes", type=float,
                   help="stop (and save) this session after this many minutes of wall time "
                        "(a session's end on a shared machine; --max-cpu-minutes is the budget)")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT/checkpoint up to --steps (the first session's data "
                        "files and settings; --steps may be raised)")
    p.add_argument("--max-rows", type=int, help="use only the first N rows of the data")


def _add_trainer(sub: Any, name: str, summary: str, description: str, *, base: str,
                 out: str) -> argparse.ArgumentParser:
    """A trainer's subcommand with what every trainer reads and writes: ``--base`` (the
    checkpoint it trains on), ``--out`` and ``--data``."""
    p = sub.add_parser(name, help=summary, description=description)
    p.add_argument("--base", required=True, help=base)
    p.add_argument("--out", help=out)
    _add_data_arg(p)
    return p


def _add_data_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", default=["synthetic"], metavar="SOURCE",
                   help="'synthetic' (the synthetic language; for the tiny bundled models) or "
                        "text files, folders (*.py *.txt *.md *.rst, recursive) and JSONL "
                        "files (field 'text', or pre-tokenized 'token_ids'), tokenized with "
                        "the base checkpoint's tokenizer")


def wall_deadline(minutes: float | None) -> float | None:
    """``--max-wall-minutes`` as the ``time.monotonic()`` instant the trainers stop at."""
    import time

    return None if minutes is None else time.monotonic() + 60 * minutes


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, batch_size=args.batch_size, seq_len=args.seq_len,
        seed=args.seed, num_threads=args.num_threads or None, log_every=args.log_every,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diffspec.train",
        description="Train diffusion drafters by self-distillation (the AR model is frozen "
                    "and is its own teacher).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    o = _add_trainer(
        sub, "orthrus", "distill Orthrus diffusion heads (*_diff projections) onto a Qwen3 or "
        "Llama",
        "Train only the *_diff attention projections: forward KL from the AR view to the "
        "diffusion view on random anchor blocks [x_a, <mask> x (K-1)]. Saves a full Orthrus "
        "checkpoint (AR weights unchanged).",
        base="Qwen3 / Llama checkpoint folder (diffusion heads start as the AR projections) or "
        "an Orthrus checkpoint (training continues)",
        out="output checkpoint folder (omit for a dry run)")
    o.add_argument("--block-size", type=int, default=16, help="K: anchor + K-1 masks (real: 32)")
    o.add_argument("--mask-token-id", type=int,
                   help="default: the base tokenizer's mask_token (Qwen3: pass 151669; a "
                        "Llama vocabulary has no spare row: pass an existing token id)")
    o.add_argument("--num-anchors", type=int, default=8, help="blocks per row")
    o.add_argument("--ce-weight", type=float, default=0.0,
                   help="add this x CE on the true next tokens (default 0: pure KL)")
    o.add_argument("--temperature", type=float, default=1.0, help="KL temperature")
    o.add_argument("--rank", type=rank_arg,
                   help="delta heads: each *_diff projection = frozen AR weight + B @ A "
                        "(rank R, B = 0 at the start), or 'full': + a dense delta (every "
                        "weight trains, as in the paper); --out then receives a compact heads "
                        "folder (heads.safetensors + heads.json, deltas in bf16); make the "
                        "full checkpoint with diffspec.model_executors.reference.orthrus."
                        "materialize_orthrus(base, heads, out)")
    o.add_argument("--measure", action="store_true",
                   help="after training, measure TPF / acceptance with the reference decoder on "
                        "synthetic prompts (synthetic-language models only)")
    a = o.add_argument_group(
        "answer rows (real models: python -m training.sharegpt shards)",
        "--answers-only trains on whole conversation rows (JSONL token_ids + prompt_len), "
        "anchors in the answers only, one row per forward, resumable and CPU-budgeted; "
        "--out receives the heads (with --rank) plus checkpoint/state.pt")
    a.add_argument("--answers-only", action="store_true",
                   help="conversation rows, anchors in answers (rows longer than --seq-len "
                        "keep their beginning)")
    _add_run_args(a, "the heads", save_every=25)
    a.add_argument("--init-heads", metavar="HEADS",
                   help="start from this heads folder (e.g. diffspec/assets/"
                        "smollm2-orthrus-heads) instead of untrained heads: a new run "
                        "continues them (its rank, block size and mask token)")
    a.add_argument("--block-widths", type=_widths, default=None, metavar="W,W,..",
                   help="draft each anchor's block at a width drawn from these (2..K, e.g. "
                        "2,3,4,6,8 for K = 8): the shorter blocks the adaptive policy "
                        "drafts at; default every block at K")
    a.add_argument("--loss", choices=("kl", "ce"), default="kl",
                   help="kl: forward KL to the AR view's distribution (default); ce: "
                        "cross-entropy on the AR view's argmax, what greedy verify accepts")
    a.add_argument("--snapshot-every", type=int, default=0,
                   help="also keep the heads of every N-th step in OUT/snapshots/ (for the "
                        "acceptance-vs-training-tokens curve)")
    _add_train_args(o, TrainConfig(steps=1200, lr=3e-3, batch_size=16, seq_len=192))

    n = _add_trainer(
        sub, "nld-lora", "train the NLD linear self-speculation draft LoRA (o_proj)",
        "Train only a LoRA on o_proj, active in the draft pass: LK (or KL) against the AR view "
        "+ CE on its greedy tokens, over each block's accepted prefix plus one. Saves the "
        "checkpoint (weights hard-linked) plus linear_spec_lora/ in PEFT format.",
        base="NLD checkpoint folder", out="output checkpoint folder (must differ from --base)")
    n.add_argument("--rank", type=int, default=16, help="LoRA r (real NLD: 128)")
    n.add_argument("--alpha", type=int, default=64, help="LoRA alpha (real NLD: 512)")
    n.add_argument("--num-anchors", type=int, default=8, help="blocks per row")
    n.add_argument("--divergence", choices=("lk", "kl"), default="lk",
                   help="lk: -log sum min(p, q) (acceptance); kl: forward KL")
    n.add_argument("--ce-weight", type=float, default=1.0,
                   help="weight of CE on the AR view's greedy tokens")
    n.add_argument("--self-generate-prefix", type=int, metavar="N",
                   help="keep N data tokens per row and replace the rest by the model's own "
                        "greedy continuation (targets then equal the verifier exactly)")
    n.add_argument("--keep-lora", action="store_true",
                   help="continue training the checkpoint's linear_spec_lora/ instead of a "
                        "fresh LoRA")
    n.add_argument("--measure", action="store_true",
                   help="after training, measure TPF / acceptance before and after the LoRA "
                        "(synthetic-language NLD from `nld-base` only)")
    _add_train_args(n, TrainConfig(steps=400, lr=2e-3, batch_size=16, seq_len=192))

    b = sub.add_parser(
        "nld-base", help="train a tiny NLD base on the synthetic language (tests, demos)",
        description="A 2-layer NLD (Ministral3) trained from scratch on the synthetic "
                    "language with AR CE + block-diffusion CE, saved in the NLD layout "
                    "without a LoRA. Test scale only.",
    )
    b.add_argument("--out", required=True)
    b.add_argument("--steps", type=int, default=600)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--lr", type=float, default=3e-3)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = "python -m diffspec.train " + shlex.join(argv)
    if args.cmd == "orthrus":
        return _orthrus(args, command)
    if args.cmd == "nld-lora":
        return _nld_lora(args, command)
    from diffspec.train.nld_lora import train_tiny_nld_base

    record = train_tiny_nld_base(args.out, steps=args.steps, seed=args.seed,
                                 block_size=args.block_size, lr=args.lr)
    _print_summary(record)
    return 0


def _orthrus(args: argparse.Namespace, command: str) -> int:
    from diffspec.train.orthrus import (
        measure_orthrus,
        train_orthrus,
        train_orthrus_answers,
        write_training_md,
    )

    if args.answers_only:
        if args.measure:
            raise SystemExit("--measure is for synthetic-language models; measure heads "
                             "trained with --answers-only in an engine (benchmarks/)")
        result = train_orthrus_answers(
            args.base, args.out, _config(args), data=args.data, block_size=args.block_size,
            mask_token_id=args.mask_token_id, num_anchors=args.num_anchors, rank=args.rank,
            init_heads=args.init_heads, block_widths=args.block_widths, loss=args.loss,
            save_every=args.save_every, snapshot_every=args.snapshot_every,
            max_cpu_s=None if args.max_cpu_minutes is None else 60 * args.max_cpu_minutes,
            deadline=wall_deadline(args.max_wall_minutes), resume=args.resume,
            max_rows=args.max_rows, autocast_bf16=args.autocast_bf16,
            command=command,
        )
        keys = ("steps", "tokens_seen", "cpu_time_s", "wall_time_s", "first_loss",
                "final_metrics_mean_last_20", "estimated_acceptance_length")
        print(json.dumps({k: result.record[k] for k in keys}, indent=2))
        return 0
    if args.init_heads is not None:
        raise SystemExit("--init-heads needs --answers-only (it continues a heads folder on "
                         "conversation rows)")
    if args.resume or args.max_cpu_minutes is not None or args.max_wall_minutes is not None:
        raise SystemExit("--resume / --max-cpu-minutes / --max-wall-minutes need "
                         "--answers-only (the packed-row trainer runs in one session)")

    result = train_orthrus(
        args.base, args.out, _config(args), data=args.data, block_size=args.block_size,
        mask_token_id=args.mask_token_id, num_anchors=args.num_anchors,
        ce_weight=args.ce_weight, temperature=args.temperature, rank=args.rank,
        command=command,
    )
    if not result.fit.is_main_process:
        return 0
    _print_summary(result.record)
    if args.measure:
        from diffspec.core.checkpoint import resolve_checkpoint
        from diffspec.model_executors.reference.orthrus import orthrus_from_base

        base = resolve_checkpoint(args.base)
        untrained = orthrus_from_base(base, result.model.block_size, result.model.mask_token_id)
        result.record["measured"] = {
            "before (diff = AR copies)": measure_orthrus(untrained),
            "after": measure_orthrus(result.model),
        }
        print(json.dumps(result.record["measured"], indent=2))
    if result.out_dir is not None:
        (result.out_dir / "training.json").write_text(json.dumps(result.record, indent=2) + "\n")
        write_training_md(result.out_dir, result.record,
                          f"{result.out_dir.name}: Orthrus diffusion heads distilled onto "
                          f"{result.record['config']['extra']['base_name']}")
    return 0


def _nld_lora(args: argparse.Namespace, command: str) -> int:
    from diffspec.train.nld_lora import train_nld_lora

    result = train_nld_lora(
        args.base, args.out, _config(args), data=args.data, rank=args.rank, alpha=args.alpha,
        num_anchors=args.num_anchors, divergence=args.divergence, ce_weight=args.ce_weight,
        self_generate_prefix=args.self_generate_prefix, fresh_lora=not args.keep_lora,
        command=command,
    )
    if not result.fit.is_main_process:
        return 0
    _print_summary(result.record)
    if args.measure:
        from diffspec.train.nld_lora import measure_nld_lora

        print(json.dumps(measure_nld_lora(result.model), indent=2))
    return 0


def _print_summary(record: dict) -> None:
    keys = ("first_loss", "final_loss_mean_last_20", "final_metrics", "wall_time_s",
            "trainable_parameters")
    print(json.dumps({k: record[k] for k in keys if k in record}, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
