"""A tiny ReFusion-style model: the bundled synth-qwen3 fine-tuned with ReFusion's objective.

ReFusion (``ML-GSAI/ReFusion``, ``qwen3/modeling_qwen3_refusion.py``, ``forward_process``)
fine-tunes a causal Qwen3 on (query, response) pairs. Per example:

* the response is cut into slots of one size drawn from {4, 8, 16, 32} (the last slot may
  be shorter); ``t ~ U(0, 1)``, ``p_mask = (1 - eps) t + eps``; each slot is masked with
  probability ``p_mask``;
* the sequence is ``[query, clean slots in shuffled order, masked slots in original order]``
  with every token at its **true** position id, under the plain causal mask;
* **AR loss** on the clean slots: each token predicts the next token *of its slot* (the
  last token of a slot predicts nothing), mean over those tokens;
* **MDM loss** on the masked slots: each ``<|mask|>`` predicts its own token (unshifted),
  cross-entropy / ``p_mask`` / response length, summed, divided by the batch size;
* loss = AR loss + MDM loss.

This module follows that objective exactly. What is simplified: the data (the synthetic
language of :mod:`diffspec.testing.synthetic`, packed documents cut at a random point into
a query and a response instead of chat pairs), the scale (2 layers, 371k parameters,
starting from the bundled AR model ``synth-qwen3`` rather than Qwen3-8B) and the schedule.
The real run uses lr 2e-5 (cosine, 4 epochs, bf16); here a higher lr (1e-3) fits the small
budget.

CLI::

    python -m diffspec.testing.synthetic_refusion train --out DIR [--steps N --seed S]
    python -m diffspec.testing.synthetic_refusion eval --model DIR [--slot-size 8 ...]
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
from itertools import pairwise
from pathlib import Path
from typing import Any

from diffspec.testing.synthetic import MASK, _sample_document, language, vocabulary

__all__ = [
    "ReFusionTrainConfig",
    "evaluate",
    "refusion_example",
    "refusion_loss",
    "train_synthetic_refusion",
    "valid_bigram_rate",
]

SLOT_SIZES = (4, 8, 16, 32)  # forward_process's slot_size_set
IGNORE = -100


@dataclass(frozen=True)
class ReFusionTrainConfig:
    steps: int = 600
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128  # query + response
    query_len: tuple[int, int] = (16, 64)  # inclusive range of the query length
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0  # as train.sh
    eps: float = 1e-3  # p_mask floor, as forward_process
    num_threads: int = 1


def _stream(rng: random.Random, vocab: dict[str, int], n: int) -> list[int]:
    """``n`` tokens of packed synthetic documents, starting at a document start."""
    row: list[int] = []
    while len(row) < n:
        row += [vocab[w] for w in _sample_document(rng)]
    return row[:n]


def refusion_example(
    tokens: list[int], query_len: int, size: int, mask_id: int, rng: random.Random, eps: float
) -> tuple[list[int], list[int], list[int], list[bool], float]:
    """ReFusion's ``forward_process`` for one example with slots of ``size``: ``(input_ids,
    position_ids, labels, is_masked, p_mask)``, lists of ``len(tokens)`` (p_mask a float)."""
    query, response = tokens[:query_len], tokens[query_len:]
    starts = list(range(0, len(response), size))
    p_mask = (1 - eps) * rng.random() + eps
    masked = [rng.random() < p_mask for _ in starts]
    clean = [i for i, m in enumerate(masked) if not m]
    rng.shuffle(clean)
    ids, pos, labels = list(query), list(range(query_len)), [IGNORE] * query_len
    is_masked = [False] * query_len
    for i in clean + [i for i, m in enumerate(masked) if m]:
        slot = response[starts[i] : starts[i] + size]
        slot_pos = list(range(query_len + starts[i], query_len + starts[i] + len(slot)))
        if masked[i]:
            ids += [mask_id] * len(slot)
            labels += slot  # a mask predicts its own token
        else:
            ids += slot
            labels += slot[1:] + [IGNORE]  # next token of the same slot
        pos += slot_pos
        is_masked += [masked[i]] * len(slot)
    return ids, pos, labels, is_masked, p_mask


def refusion_loss(model, batch: dict[str, Any]):
    """AR loss (mean over clean-slot targets) + MDM loss (CE / p_mask / response length,
    summed over masked tokens, / batch size): ReFusion's training loss."""
    import torch
    import torch.nn.functional as F

    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=torch.ones_like(batch["input_ids"]))  # 2-D ones: no packing
    logits = out.logits.float()  # [batch, seq, vocab]
    labels, is_masked = batch["labels"], batch["is_masked"]  # [batch, seq]
    ce = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    ar = (~is_masked) & (labels != IGNORE)
    ar_loss = ce[ar].mean() if ar.any() else ce.sum() * 0
    weight = 1.0 / (batch["p_mask"] * batch["response_len"])  # [batch, 1]
    mdm_loss = (ce * weight * is_masked).sum() / labels.shape[0]
    return ar_loss + mdm_loss, ar_loss, mdm_loss


def _batch(rng: random.Random, vocab: dict[str, int], cfg: ReFusionTrainConfig, mask_id: int):
    import torch

    rows = []
    for _ in range(cfg.batch_size):
        query_len, size = rng.randint(*cfg.query_len), rng.choice(SLOT_SIZES)
        example = refusion_example(_stream(rng, vocab, cfg.seq_len), query_len, size, mask_id,
                                   rng, cfg.eps)
        rows.append((*example, cfg.seq_len - query_len))
    ids, pos, labels, masked, p_mask, response_len = zip(*rows)
    return {
        "input_ids": torch.tensor(ids),  # [batch, seq]
        "position_ids": torch.tensor(pos),  # [batch, seq]
        "labels": torch.tensor(labels),  # [batch, seq]
        "is_masked": torch.tensor(masked),  # [batch, seq]
        "p_mask": torch.tensor(p_mask)[:, None],  # [batch, 1]
        "response_len": torch.tensor(response_len, dtype=torch.float)[:, None],  # [batch, 1]
    }


def train_synthetic_refusion(
    out_dir: str | Path, base: str | Path | None = None, command: str | None = None, **overrides
) -> dict[str, Any]:
    """Fine-tune ``base`` (default: the bundled synth-qwen3) with the ReFusion objective
    and save a ReFusion-layout checkpoint (stock Qwen3 + ``config.mask_token_id``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR

    cfg = ReFusionTrainConfig(**overrides)
    base = Path(base or SYNTH_QWEN3_DIR)
    out = Path(out_dir)
    vocab = {t: i for i, t in enumerate(vocabulary())}
    mask_id = vocab[MASK]
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM.from_pretrained(str(base), dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                weight_decay=cfg.weight_decay)
        rng = random.Random(cfg.seed)
        log: list[dict[str, float]] = []
        start = time.perf_counter()
        for step in range(cfg.steps):
            warm = (step + 1) / cfg.warmup
            decay = 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            for group in opt.param_groups:
                group["lr"] = cfg.lr * min(warm, decay)
            loss, ar, mdm = refusion_loss(model, _batch(rng, vocab, cfg, mask_id))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            log.append({"loss": loss.item(), "ar": ar.item(), "mdm": mdm.item()})
            if step % 50 == 0 or step == cfg.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.3f}  ar {ar.item():.3f}  "
                      f"mdm {mdm.item():.3f}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)

    model.eval()
    model.config.mask_token_id = mask_id
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, out / name)
    tail = log[-50:]
    record = {
        "command": command or f"python -m diffspec.testing.synthetic_refusion train --out {out}",
        "base": base.name,
        "final_loss_mean_last_50": {k: round(sum(r[k] for r in tail) / len(tail), 4)
                                    for k in ("loss", "ar", "mdm")},
        "wall_time_s": round(wall, 1),
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ---------------------------------------------------------------------------- evaluation


def valid_bigram_rate(words: list[str]) -> float:
    """Fraction of consecutive word pairs the language can produce (inside a phrase, or a
    phrase end followed by a phrase start); a quality check that needs no reference."""
    lang = language()
    ok: set[tuple[str, str]] = set()
    for p in lang.phrases:
        ok.update(pairwise(p))
        ok.update((p[-1], q[0]) for q in lang.phrases)
    pairs = [(a, b) for a, b in pairwise(words) if a in lang.words and b in lang.words]
    return sum(p in ok for p in pairs) / max(1, len(pairs))


def evaluate(model_dir: str | Path, slot_size: int, num_blocks: int, slot_threshold: float,
             token_threshold: float, max_tokens: int, num_prompts: int, seed: int) -> dict:
    """ReFusion decoding of synthetic prompts: TPF, slots per plan, quality vs AR."""
    import torch

    from diffspec.spec_workers.reference.decoder import Request, ar_generate
    from diffspec.model_executors.reference.refusion import load_refusion
    from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts

    torch.set_num_threads(1)
    model, info = load_refusion(model_dir)
    tok = build_tokenizer()
    cfg = ReFusionConfig(slot_size, num_blocks, slot_threshold, token_threshold)
    requests = [Request(tok(p)["input_ids"], max_tokens=max_tokens,
                        stop_token_ids=info.eos_token_ids)
                for p in sample_prompts(num_prompts, seed)]
    start = time.perf_counter()
    outs = refusion_generate(model, requests, cfg, info.mask_token_id)
    wall = time.perf_counter() - start
    ar = ar_generate(model, requests)
    plans = [k for o in outs for k in o.slots_per_plan]
    words = [tok.convert_ids_to_tokens(o.token_ids) for o in outs]
    same = [sum(a == b for a, b in zip(o.token_ids, r.token_ids)) / max(len(r.token_ids), 1)
            for o, r in zip(outs, ar)]
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.num_forwards for o in outs)
    return {
        "config": asdict(cfg),
        "max_tokens": max_tokens,
        "prompts": num_prompts,
        "tokens": tokens,
        "forwards": forwards,
        "tpf": round(tokens / forwards, 3),
        "ar_tpf": round(sum(len(r.token_ids) for r in ar) / sum(r.num_forwards for r in ar), 3),
        "mean_slots_per_plan": round(sum(plans) / len(plans), 3),
        "slots_per_plan_hist": {k: plans.count(k) for k in sorted(set(plans))},
        "draft_acceptance": round(sum(o.num_accepted_tokens for o in outs)
                                  / max(1, sum(o.num_draft_tokens for o in outs)), 3),
        "valid_bigram_rate": round(sum(valid_bigram_rate(w) for w in words) / len(words), 3),
        "ar_valid_bigram_rate": round(sum(valid_bigram_rate(tok.convert_ids_to_tokens(
            r.token_ids)) for r in ar) / len(ar), 3),
        "same_token_as_ar": round(sum(same) / len(same), 3),
        "stopped": sum(o.finish_reason == "stop" for o in outs),
        "wall_s": round(wall, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffspec.testing.synthetic_refusion")
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="fine-tune synth-qwen3 with the ReFusion objective")
    train.add_argument("--out", required=True)
    train.add_argument("--steps", type=int, default=ReFusionTrainConfig.steps)
    train.add_argument("--seed", type=int, default=ReFusionTrainConfig.seed)
    ev = sub.add_parser("eval", help="TPF and slots per plan of ReFusion decoding")
    ev.add_argument("--model", required=True)
    ev.add_argument("--slot-size", type=int, default=8)
    ev.add_argument("--num-blocks", type=int, default=2)
    ev.add_argument("--slot-threshold", type=float, default=0.9)
    ev.add_argument("--token-threshold", type=float, default=0.4)
    ev.add_argument("--max-tokens", type=int, default=64)
    ev.add_argument("--prompts", type=int, default=20)
    ev.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        cmd = (f"python -m diffspec.testing.synthetic_refusion train --out {args.out} "
               f"--steps {args.steps} --seed {args.seed}")
        record = train_synthetic_refusion(args.out, steps=args.steps, seed=args.seed, command=cmd)
        print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2))
    else:
        print(json.dumps(evaluate(args.model, args.slot_size, args.num_blocks,
                                  args.slot_threshold, args.token_threshold, args.max_tokens,
                                  args.prompts, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
