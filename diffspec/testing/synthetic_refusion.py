"""A tiny ReFusion-style model: the bundled synth-qwen3 fine-tuned with ReFusion's objective.

Design notes: docs/design/testing.md (section ``diffspec/testing/synthetic_refusion.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from diffspec.assets import ASSETS_DIR
from diffspec.methods import METHODS
from diffspec.testing import synthetic

__all__ = [
    "ReFusionTrainConfig",
    "build_parser",
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
        tokens = synthetic.packed_tokens(rng, vocab, cfg.seq_len)
        example = refusion_example(tokens, query_len, size, mask_id, rng, cfg.eps)
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

    cfg = ReFusionTrainConfig(**overrides)
    vocab = synthetic.vocabulary_ids()
    mask_id = vocab[synthetic.MASK]
    rng = random.Random(cfg.seed)

    def loss_fn(model, batch):
        loss, ar, mdm = refusion_loss(model, batch)
        return {"loss": loss, "ar": ar, "mdm": mdm}

    base, result = synthetic.fine_tune_qwen3(
        out_dir, base, cfg, lambda: _batch(rng, vocab, cfg, mask_id), loss_fn,
        {"mask_token_id": mask_id})
    return synthetic.write_record(out_dir, {
        "command": command
        or f"python -m diffspec.testing.synthetic_refusion train --out {out_dir}",
        "base": base.name,
        "final_loss_mean_last_50": synthetic.tail_means(result.history, 50,
                                                        ("loss", "ar", "mdm")),
        "wall_time_s": round(result.wall_time_s, 1),
        "config": asdict(cfg),
        "torch": torch.__version__,
    })


# ---------------------------------------------------------------------------- evaluation


def valid_bigram_rate(words: list[str]) -> float:
    """Fraction of consecutive word pairs the language can produce (inside a phrase, or a
    phrase end followed by a phrase start); a quality check that needs no reference."""
    lang = synthetic.language()
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

    from diffspec.model_executors.reference.refusion import load_refusion
    from diffspec.spec_workers.reference.decoder import ar_generate
    from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate

    torch.set_num_threads(1)
    model, info = load_refusion(model_dir)
    tok = synthetic.build_tokenizer()
    cfg = ReFusionConfig(slot_size, num_blocks, slot_threshold, token_threshold)
    requests = synthetic.prompt_requests(num_prompts, seed, max_tokens, info.eos_token_ids)
    start = time.perf_counter()
    outs = refusion_generate(model, requests, cfg, info.mask_token_id)
    wall = time.perf_counter() - start
    ar = ar_generate(model, requests)
    plans = [k for o in outs for k in o.slots_per_plan]
    words = [tok.convert_ids_to_tokens(o.token_ids) for o in outs]
    same = [sum(a == b for a, b in zip(o.token_ids, r.token_ids)) / max(len(r.token_ids), 1)
            for o, r in zip(outs, ar)]
    return {
        "config": asdict(cfg),
        "max_tokens": max_tokens,
        "prompts": num_prompts,
        **synthetic.decode_summary(outs, wall),
        "ar_tpf": round(sum(len(r.token_ids) for r in ar) / sum(r.num_forwards for r in ar), 3),
        "mean_slots_per_plan": round(sum(plans) / len(plans), 3),
        "slots_per_plan_hist": {k: plans.count(k) for k in sorted(set(plans))},
        "valid_bigram_rate": round(sum(valid_bigram_rate(w) for w in words) / len(words), 3),
        "ar_valid_bigram_rate": round(sum(valid_bigram_rate(tok.convert_ids_to_tokens(
            r.token_ids)) for r in ar) / len(ar), 3),
        "same_token_as_ar": round(sum(same) / len(same), 3),
    }


_MODULE = "diffspec.testing.synthetic_refusion"


def build_parser() -> argparse.ArgumentParser:
    """``train`` and ``eval``; ``eval`` decodes with the registry's refusion defaults (those
    of ``diffspec generate --method refusion``) unless told otherwise."""
    parser, sub, _ = synthetic.trainer_cli(
        _MODULE, "fine-tune synth-qwen3 with the ReFusion objective", ReFusionTrainConfig)
    ev = sub.add_parser("eval", help="TPF and slots per plan of ReFusion decoding (default "
                        "settings: those of `diffspec generate --method refusion`)")
    ev.add_argument("--model", default=str(ASSETS_DIR / METHODS["refusion"].bundled),
                    help="checkpoint folder (default: the bundled synth-refusion)")
    defaults = METHODS["refusion"].defaults
    ev.add_argument("--slot-size", type=int, default=defaults["slot_size"])
    ev.add_argument("--num-blocks", type=int, default=defaults["num_blocks"])
    ev.add_argument("--slot-threshold", type=float, default=defaults["slot_threshold"])
    ev.add_argument("--token-threshold", type=float, default=defaults["token_threshold"])
    synthetic.add_prompt_args(ev, prompts=20)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "train":
        return synthetic.run_train(_MODULE, args, train_synthetic_refusion)
    print(json.dumps(evaluate(args.model, args.slot_size, args.num_blocks, args.slot_threshold,
                              args.token_threshold, args.max_tokens, args.prompts, args.seed),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
