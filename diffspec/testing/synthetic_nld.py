"""A tiny Nemotron-Labs-Diffusion (NLD) model on the synthetic language, with a trained draft LoRA.

Design notes: docs/design/testing.md (section ``diffspec/testing/synthetic_nld.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from diffspec.assets import SYNTH_NLD_DIR

__all__ = ["SYNTH_NLD_DIR", "measure", "train_synthetic_nld", "write_synthetic_nld_base"]

# The backbone: the synth-qwen3 sizes on a Ministral3 (the NLD backbone).
SIZES = {"hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
MODEL_MAX_LENGTH = 4096  # tokenizer limit; the config keeps NLD's 262144 (YaRN)


def write_synthetic_nld_base(out: str | Path, *, block_size: int, seed: int) -> Path:
    """An untrained NLD checkpoint (seeded weights, no LoRA) with the synthetic tokenizer:
    :func:`~diffspec.testing.checkpoints.write_nld`'s config and tensors, then the synthetic
    vocabulary's tokenizer, special ids and generation config."""
    from diffspec.testing.checkpoints import write_nld
    from diffspec.testing.synthetic import (
        ENDOFTEXT,
        EOS_TOKENS,
        MASK,
        save_synthetic_tokenizer,
        vocabulary,
    )

    out = Path(out)
    vocab = {t: i for i, t in enumerate(vocabulary())}
    with tempfile.TemporaryDirectory() as tmp:
        layout = write_nld(Path(tmp) / "nld", with_lora=False, block_size=block_size, seed=seed,
                           words=[], vocab_size=len(vocab), **SIZES)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(layout / "model.safetensors", out / "model.safetensors")
        config = json.loads((layout / "config.json").read_text())
    config.update(bos_token_id=None, eos_token_id=vocab[ENDOFTEXT], pad_token_id=vocab[ENDOFTEXT],
                  mask_token_id=vocab[MASK])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [vocab[t] for t in EOS_TOKENS], "pad_token_id": vocab[ENDOFTEXT]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_synthetic_tokenizer(out, MODEL_MAX_LENGTH)
    return out


def train_backbone(
    out: str | Path,
    *,
    steps: int,
    seed: int,
    block_size: int,
    lr: float = 3e-3,
    batch_size: int = 16,
    seq_len: int = 192,
    diffusion_weight: float = 1.0,
) -> dict[str, Any]:
    """Stage 1: write :func:`write_synthetic_nld_base` to ``out`` and train all its weights
    with AR CE + ``diffusion_weight`` x block-diffusion CE; saves ``model.safetensors``."""
    from diffspec.train import TrainConfig
    from diffspec.train.nld_lora import fit_nld_base

    out = write_synthetic_nld_base(out, block_size=block_size, seed=seed)
    cfg = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, seq_len=seq_len, seed=seed,
                      log_every=50, warmup_steps=30, weight_decay=0.01)
    cfg.extra.update(method="nld-base (synthetic tokenizer)", block_size=block_size,
                     diffusion_weight=diffusion_weight, data=["synthetic"])
    result, record = fit_nld_base(out, cfg, block_size, diffusion_weight)
    tail = result.history[-20:]
    record["final_terms_mean_last_20"] = {
        k: round(sum(h[k] for h in tail) / len(tail), 4) for k in ("ar_ce", "diffusion_ce")}
    record["recipe"] = (f"AR CE + {diffusion_weight} x block-diffusion CE (block {block_size}, "
                        f"unshifted)")
    return record


def measure(model_dir: str | Path, *, num: int = 16, seed: int = 1234,
            max_tokens: int = 64) -> dict[str, dict[str, Any]]:
    """Greedy linear self-speculation on ``model_dir`` (``block_size - 1`` drafts per step,
    reference decoder, fp32) against plain AR, on ``sample_prompts(num, seed)`` and the
    first 24 tokens of held-out documents: drafting with the backbone alone (what an
    untrained LoRA gives: PEFT starts with B = 0) and with the shipped LoRA."""
    import dataclasses

    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter
    from diffspec.testing.synthetic import synthetic_eval_prompts
    from diffspec.train import measure_speculation, torch_threads
    from diffspec.train.data import load_tokenizer

    with torch_threads(1):
        nld = load_nld(model_dir)
        prompts = synthetic_eval_prompts(load_tokenizer(model_dir), num=num, seed=seed)
        report: dict[str, dict[str, Any]] = {}
        for name, model in (("backbone only (untrained LoRA)", dataclasses.replace(nld, peft=None)),
                            ("trained LoRA", nld)):
            report[name] = {
                set_name: measure_speculation(nld.lm, LinearSelfSpecDrafter(model), ids,
                                              nld.block_size - 1, max_tokens=max_tokens,
                                              stop_token_ids=nld.eos_token_ids)
                for set_name, ids in prompts.items()
            }
    return report


def train_synthetic_nld(
    out_dir: str | Path,
    *,
    base_steps: int = 600,
    lora_steps: int = 400,
    seed: int = 0,
    block_size: int = 16,
    rank: int = 16,
    alpha: int = 64,
    self_generate_prefix: int = 24,
    command: str | None = None,
) -> dict[str, Any]:
    """Both stages, then the measurement; writes the checkpoint, ``training.json`` and
    ``TRAINING.md`` to ``out_dir``. Deterministic (seeded, one thread)."""
    import torch

    from diffspec.train import TrainConfig
    from diffspec.train.nld_lora import LORA_DIR, save_linear_spec_lora, train_nld_lora

    out = Path(out_dir)
    command = command or (f"python -m diffspec.testing.synthetic_nld --out {out} "
                          f"--base-steps {base_steps} --lora-steps {lora_steps} --seed {seed} "
                          f"--block-size {block_size}")
    start, start_cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        backbone = train_backbone(base, steps=base_steps, seed=seed, block_size=block_size)
        cfg = TrainConfig(steps=lora_steps, lr=2e-3, batch_size=16, seq_len=192, seed=seed)
        lora = train_nld_lora(base, None, cfg, rank=rank, alpha=alpha,
                              self_generate_prefix=self_generate_prefix, num_anchors=8,
                              divergence="lk", ce_weight=1.0)
        out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out / LORA_DIR, ignore_errors=True)  # no stale adapter files
        for name in ("config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / name, out / name)
    save_linear_spec_lora(lora.model, out / LORA_DIR)
    for weights in (out / "model.safetensors", out / LORA_DIR / "adapter_model.safetensors"):
        weights.chmod(0o644)  # safetensors writes 0600
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    lora.record.pop("command", None)
    record = {
        "command": command,
        "backbone": backbone,
        "lora": lora.record,
        "wall_time_s": round(wall, 1),
        "cpu_time_s": round(cpu, 1),
        "torch": torch.__version__,
    }
    print(f"trained in {wall:.0f} s wall, {cpu:.0f} s CPU; measuring", file=sys.stderr,
          flush=True)
    record["sha256"] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                        for name in ("model.safetensors", f"{LORA_DIR}/adapter_model.safetensors")}
    record["measured"] = measure(out)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "TRAINING.md").write_text(_training_md(record))
    return record


def _training_md(r: dict[str, Any]) -> str:
    b, lo = r["backbone"], r["lora"]
    bc, lc = b["config"], lo["config"]
    be, le = bc["extra"], lc["extra"]
    rows = []
    for drafter, sets in r["measured"].items():
        for prompts, m in sets.items():
            rows.append(f"| `{prompts}` | linear_self_spec, {drafter} | {m['tpf']} | "
                        f"{m['mean_accept_length']} | {m['mean_accepted_drafts']} | "
                        f"{m['tokens']} / {m['forwards']} | {'yes' if m['equal_ar'] else 'NO'} |")
    for prompts, m in next(iter(r["measured"].values())).items():
        rows.append(f"| `{prompts}` | plain AR | 1.0 | 1.0 | 0 | {m['tokens']} / {m['tokens']} "
                    f"| (reference) |")
    table = "\n".join(rows)
    return f"""# synth-nld: a tiny Nemotron-Labs-Diffusion model with a trained draft LoRA

A 2-layer NLD (Ministral3 backbone, hidden 128, {b['trainable_parameters']:,} parameters)
trained from scratch on diffspec's synthetic language (`diffspec/testing/synthetic.py`),
plus the linear self-speculation draft LoRA (`linear_spec_lora/`, PEFT, rank {le['rank']} /
alpha {le['alpha']} on `o_proj`, {lo['trainable_parameters']:,} parameters, active only in the
draft pass). Published NLD layout: `config.json` with `model_type: nemotron_labs_diffusion`,
`block_size: {be['block_size']}`, `mask_token_id: 3` (`<|mask|>`); tensors `encoder.*` +
`diffusion_head.weight`; the synthetic language's tokenizer (same ids as synth-qwen3;
`<|endoftext|>` and `<|im_end|>` stop generation).

Trained on CPU, 1 thread, deterministically (seeded), by:

    {r['command']}

Total: {r['wall_time_s']} s wall, {r['cpu_time_s']} s CPU (2-core machine shared with other
jobs, so wall > CPU), torch {r['torch']}. Code: `diffspec/testing/synthetic_nld.py`.
sha256 of the weights (a rerun of the command reproduces them bit for bit):
`model.safetensors` {r['sha256']['model.safetensors']},
`linear_spec_lora/adapter_model.safetensors`
{r['sha256']['linear_spec_lora/adapter_model.safetensors']}.

## Stage 1: backbone (all weights)

| field | value |
|---|---|
| objective | {b['recipe']} (the step of `diffspec.train.nld_lora.train_tiny_nld_base`) |
| data | synthetic documents (`diffspec.train.data.synthetic_documents(seed={bc['seed']})`), rows of {bc['seq_len']} tokens, {bc['batch_size']} rows per step |
| steps / seed | {bc['steps']} / {bc['seed']} |
| optimizer | AdamW lr {bc['lr']} (warmup {bc['warmup_steps']}, cosine to {bc['min_lr_ratio']}x), betas {tuple(bc['betas'])}, weight decay {bc['weight_decay']}, clip {bc['max_grad_norm']} (`diffspec.train.fit`) |
| loss: first step / mean of last 20 | {b['first_loss']} / {b['final_loss_mean_last_20']} |
| AR CE / block-diffusion CE, mean of last 20 | {b['final_terms_mean_last_20']['ar_ce']} / {b['final_terms_mean_last_20']['diffusion_ce']} |
| time | {b['wall_time_s']} s wall, {b['cpu_time_s']} s CPU |

## Stage 2: draft LoRA (`diffspec.train.nld_lora.train_nld_lora`, the `nld-lora` trainer)

| field | value |
|---|---|
| objective | {le['divergence'].upper()} (`-log sum min(p, q)`) + {le['ce_weight']} x CE on the AR view's greedy tokens, on each block's accepted prefix plus one |
| data | synthetic rows of {lc['seq_len']}: {le['self_generate_prefix']} data tokens, then the backbone's own greedy continuation; {le['num_anchors']} anchor blocks per row, {lc['batch_size']} rows per step |
| steps / seed | {lc['steps']} / {lc['seed']} |
| optimizer | AdamW lr {lc['lr']} (warmup {lc['warmup_steps']}, cosine to {lc['min_lr_ratio']}x), clip {lc['max_grad_norm']} |
| loss: first step / mean of last 20 | {lo['first_loss']} / {lo['final_loss_mean_last_20']} |
| time | {lo['wall_time_s']} s wall, {lo['cpu_time_s']} s CPU |

## Measured

    python -m diffspec.testing.synthetic_nld --eval --model diffspec/assets/synth-nld

Reference decoder (`speculative_generate` + `LinearSelfSpecDrafter`), fp32, greedy,
{be['block_size'] - 1} drafts per step (block {be['block_size']} = anchor + {be['block_size'] - 1} masks), 64 new tokens per
prompt, stop on `<|endoftext|>` / `<|im_end|>`. TPF = generated tokens / forwards (draft +
verify = 2 forwards, prefill not counted; plain AR is 1.0); acceptance length = tokens
emitted per draft + verify step (accepted drafts + 1). "backbone only" drafts with the LoRA
off, which is what a freshly initialised LoRA gives (PEFT starts with B = 0). `== AR`: every
output equals plain AR decoding token for token.

| prompts | decoding | TPF | acceptance length | accepted drafts / step | tokens / forwards | == AR |
|---|---|---|---|---|---|---|
{table}

The backbone drafts well on its own because it was trained with the block-diffusion
objective and this language is very predictable; the LoRA, trained to match the AR view's
greedy tokens, takes it to (or near) the ceiling of the block. The greedy continuations of
this language are deterministic inside a phrase, so these are best-case figures.

Full record: `training.json`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffspec.testing.synthetic_nld",
        description="Train the bundled tiny NLD (backbone + draft LoRA) on the synthetic "
                    "language, or measure linear self-speculation on it.")
    parser.add_argument("--out", help="output checkpoint folder (training)")
    parser.add_argument("--base-steps", type=int, default=600)
    parser.add_argument("--lora-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--eval", action="store_true",
                        help="measure TPF / acceptance / lossless on --model instead")
    parser.add_argument("--model", default=str(SYNTH_NLD_DIR), help="checkpoint for --eval")
    args = parser.parse_args(argv)
    if args.eval:
        print(json.dumps(measure(args.model), indent=2))
        return 0
    if not args.out:
        parser.error("--out is required (or pass --eval)")
    command = "python -m diffspec.testing.synthetic_nld " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    record = train_synthetic_nld(args.out, base_steps=args.base_steps, lora_steps=args.lora_steps,
                                 seed=args.seed, block_size=args.block_size, command=command)
    print(json.dumps(record["measured"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
