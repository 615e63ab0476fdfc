"""A tiny diffusion LM trained on the synthetic language, in a published checkpoint layout,
and the measurement of Fast-dLLM decoding on it.

Design notes: docs/design/testing.md (section ``diffspec/testing/synthetic_dllm.py``).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffspec.testing.synthetic import (
    ENDOFTEXT,
    IM_START,
    ROLE_WORDS,
    add_prompt_args,
    fit_synthetic,
    language,
    run_train,
    sample_documents,
    tail_means,
    trainer_cli,
    warmup_cosine_lr,
    write_record,
)

__all__ = ["DLLMTrainConfig", "evaluate_fast_dllm", "train_synthetic_dllm"]

LAYOUTS = ("llada", "fast_dllm_v2")


@dataclass(frozen=True)
class DLLMTrainConfig:
    layout: str = "llada"  # "llada" | "fast_dllm_v2"
    steps: int = 600
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128  # multiple of block_size
    block_size: int = 32  # Fast-dLLM v2 bd_size
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    num_threads: int = 1
    vocab_size: int = 224  # >= the tokenizer: specials + <unk> + 203 words
    hidden_size: int = 96
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 3  # head_dim 32
    num_key_value_heads: int = 1
    max_position_embeddings: int = 1024

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.seq_len % self.block_size:
            raise ValueError("seq_len must be a multiple of block_size")


def train_synthetic_dllm(
    out_dir: str | Path,
    *,
    layout: str = "llada",
    steps: int = DLLMTrainConfig.steps,
    seed: int = DLLMTrainConfig.seed,
    log_every: int = 50,
    command: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train the tiny diffusion LM from scratch into ``out_dir`` (deterministic given
    ``seed``); writes the checkpoint, ``TRAINING.md`` and ``training.json``."""
    import torch
    from safetensors.torch import save_file

    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.testing.checkpoints import write_fast_dllm_v2, write_llada

    cfg = DLLMTrainConfig(layout=layout, steps=steps, seed=seed, **overrides)
    out = Path(out_dir)
    sizes = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    words = [*ROLE_WORDS, *language().words]
    if layout == "llada":
        write_llada(out, seed=cfg.seed, words=words, **sizes)
        # the writer also records the Qwen-style size keys; LLaDA's config has its own names
        config = json.loads((out / "config.json").read_text())
        for key in set(sizes) - {"vocab_size"}:
            config.pop(key, None)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        write_fast_dllm_v2(out, seed=cfg.seed, words=words, bd_size=cfg.block_size,
                           mask_in_config=True, **sizes)
    lm = load_dllm(out)
    vocab = _vocab(out)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)

    def loss_fn(model, x0):  # x0: [batch, seq_len]
        if layout == "llada":
            return _llada_loss(model, x0, lm.mask_token_id, gen)
        return _block_diffusion_loss(model, x0, lm.mask_token_id, cfg.block_size, gen)

    model = lm.model
    result = fit_synthetic(model, lambda: _batch(rng, vocab, cfg), cfg, loss_fn=loss_fn,
                           lr_schedule=warmup_cosine_lr(cfg), log_every=log_every)

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    record = {
        "command": command or f"python -m diffspec.testing.synthetic_dllm train --layout "
        f"{layout} --out {out_dir} --steps {cfg.steps} --seed {cfg.seed}",
        "layout": layout,
        "architecture": lm.info.architecture,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "final_loss_mean_last_20": tail_means(result.history, 20)["loss"],
        "wall_time_s": round(result.wall_time_s, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "config": asdict(cfg),
        "torch": torch.__version__,
    }
    (out / "TRAINING.md").write_text(_training_md(record))
    return write_record(out, record)


def _vocab(path: Path) -> dict[str, int]:
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return vocab


def _batch(rng: random.Random, vocab: dict[str, int], cfg: DLLMTrainConfig):
    """[batch, seq_len] rows packed from plain documents, each row starting at a document."""
    import torch

    rows = []
    for _ in range(cfg.batch_size):
        row: list[int] = []
        while len(row) < cfg.seq_len:
            for doc in sample_documents(8, rng.randrange(2**31)):
                if not doc.startswith(IM_START):
                    row += [vocab[w] for w in doc.split()]
        rows.append(row[: cfg.seq_len])
    return torch.tensor(rows, dtype=torch.long)


def _llada_loss(model, x0, mask_id: int, gen, eps: float = 1e-3):
    """LLaDA's masked-diffusion loss (half of the rows keep a clean random-length prefix)."""
    import torch
    import torch.nn.functional as F

    from diffspec.core.masks import block_diffusion_mask
    from diffspec.model_executors.reference.views import block_view_logits

    b, length = x0.shape
    t = (1 - eps) * torch.rand(b, 1, generator=gen) + eps  # [batch, 1]
    masked = torch.rand(b, length, generator=gen) < t
    prefix = torch.randint(0, length, (b, 1), generator=gen)
    keep = (torch.rand(b, 1, generator=gen) < 0.5) & (torch.arange(length)[None] < prefix)
    masked &= ~keep
    xt = torch.where(masked, mask_id, x0)
    logits = block_view_logits(model, xt, torch.arange(length), None,
                               block_diffusion_mask(0, length))  # [batch, seq, vocab]
    ce = F.cross_entropy(logits[masked], x0[masked], reduction="none")
    return (ce / t.expand(b, length)[masked]).sum() / (b * length)


def _block_diffusion_loss(model, x0, mask_id: int, block: int, gen, eps: float = 1e-3):
    """Fast-dLLM v2's block-diffusion loss over ``[x_t, x_0]`` with shifted targets."""
    import torch
    import torch.nn.functional as F

    from diffspec.core.masks import block_diffusion_training_mask
    from diffspec.model_executors.reference.views import block_view_logits

    b, length = x0.shape
    t = (1 - eps) * torch.rand(b, length // block, generator=gen) + eps
    masked = torch.rand(b, length, generator=gen) < t.repeat_interleave(block, dim=1)
    masked[:, 0] = False  # nothing before it predicts slot 0
    xt = torch.where(masked, mask_id, x0)
    mask, positions = block_diffusion_training_mask(length, block)
    logits = block_view_logits(model, torch.cat([xt, x0], dim=1), positions, None, mask)
    logits = logits[:, :length]  # the noisy stream
    target = masked[:, 1:]
    return F.cross_entropy(logits[:, :-1][target], x0[:, 1:][target])


# ---------------------------------------------------------------------------- measurement


def evaluate_fast_dllm(
    model_dir: str | Path,
    *,
    num_prompts: int = 16,
    seed: int = 1,
    max_tokens: int = 64,
    thresholds: tuple[float, ...] = (1.0, 0.9),
    block_size: int | None = None,
    sub_block_size: int | None = None,
) -> list[dict[str, Any]]:
    """Decode ``num_prompts`` synthetic prompts (one batch) with every cache strategy and
    threshold; compare each with the reference (no cache, one token per step).

    Per configuration: token agreement with the reference (same token at the same index,
    over the longer of the two outputs), requests whose output equals the reference,
    TPF, mean steps per block, and the share of adjacent token pairs that the language
    allows (a quality check that needs no reference)."""
    from diffspec.model_executors.reference.dllm import load_dllm
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.spec_workers.reference.fast_dllm import (
        CACHE_MODES,
        FastDLLMConfig,
        fast_dllm_generate,
    )
    from diffspec.testing.synthetic import sample_prompts

    lm = load_dllm(model_dir)
    vocab = _vocab(Path(model_dir))
    requests = [Request([vocab[w] for w in p.split()], max_tokens=max_tokens,
                        stop_token_ids=lm.eos_token_ids)
                for p in sample_prompts(num_prompts, seed)]
    sizes = {"block_size": block_size, "sub_block_size": sub_block_size}
    legal = _legal_pairs(vocab)
    reference = fast_dllm_generate(lm, requests, FastDLLMConfig.reference(**sizes))
    rows = []
    for cache in CACHE_MODES:
        for threshold in thresholds:
            begin = time.perf_counter()
            outs = fast_dllm_generate(lm, requests,
                                      FastDLLMConfig(cache=cache, threshold=threshold, **sizes))
            wall = time.perf_counter() - begin
            match = total = 0
            for o, r in zip(outs, reference):
                total += max(len(o.token_ids), len(r.token_ids))
                match += sum(a == b for a, b in zip(o.token_ids, r.token_ids))
            tokens = sum(len(o.token_ids) for o in outs)
            pairs = [(a, b) for req, o in zip(requests, outs)
                     for a, b in zip([req.prompt_token_ids[-1], *o.token_ids], o.token_ids)]
            rows.append({
                "cache": cache, "threshold": threshold,
                "agreement": round(match / max(1, total), 4),
                "equal_outputs": sum(o.token_ids == r.token_ids for o, r in zip(outs, reference)),
                "requests": len(requests),
                "tokens": tokens,
                "forwards": sum(o.num_forwards for o in outs),
                "tpf": round(tokens / max(1, sum(o.num_forwards for o in outs)), 3),
                "steps_per_block": round(sum(sum(o.steps_per_block) for o in outs)
                                         / max(1, sum(len(o.steps_per_block) for o in outs)), 2),
                "legal_pairs": round(sum(p in legal for p in pairs) / max(1, len(pairs)), 4),
                "stopped": sum(o.finish_reason == "stop" for o in outs),
                "wall_s": round(wall, 2),
            })
    return rows


def _legal_pairs(vocab: dict[str, int]) -> set[tuple[int, int]]:
    """Adjacent token pairs the language produces: inside a phrase, phrase to phrase,
    phrase end to ``<|endoftext|>`` and back."""
    phrases = [[vocab[w] for w in p] for p in language().phrases]
    eot = vocab[ENDOFTEXT]
    pairs = {(a, b) for p in phrases for a, b in itertools.pairwise(p)}
    pairs |= {(p[-1], q[0]) for p in phrases for q in phrases}
    pairs |= {(p[-1], eot) for p in phrases} | {(eot, p[0]) for p in phrases}
    return pairs


def _training_md(r: dict[str, Any]) -> str:
    c = r["config"]
    objective = ("masked diffusion, LLaDA loss (1/t weighted)" if r["layout"] == "llada"
                 else f"block diffusion, bd_size {c['block_size']}, shifted targets")
    return f"""# {r["layout"]}: a tiny {r["architecture"]} trained on the synthetic language

Trained from scratch on CPU, deterministically (1 thread), by:

    {r["command"]}

| field | value |
|---|---|
| layout | `{r["layout"]}` ({r["architecture"]}, written by `diffspec.testing.checkpoints`) |
| objective | {objective} |
| seed / steps | {r["seed"]} / {r["steps"]} |
| mean loss, last 20 steps | {r["final_loss_mean_last_20"]} |
| wall time | {r["wall_time_s"]} s |
| parameters | {r["num_parameters"]:,} (fp32) |
| tokens seen | {r["tokens_seen"]:,} |
| torch | {r["torch"]} |

The language is defined in `diffspec/testing/synthetic.py` (plain documents only);
the objective and the measurement in `diffspec/testing/synthetic_dllm.py`. Full record:
`training.json`. Fast-dLLM figures on the bundled models: `../TRAINING.md`.
"""


def main(argv: list[str] | None = None) -> int:
    module = "diffspec.testing.synthetic_dllm"
    parser, sub, train = trainer_cli(module, "train the tiny diffusion LM and save it",
                                     DLLMTrainConfig,
                                     "Train / measure the synthetic diffusion LM.")
    train.add_argument("--layout", choices=LAYOUTS, default="llada")
    ev = sub.add_parser("eval", help="Fast-dLLM agreement / TPF on synthetic prompts")
    ev.add_argument("--model", required=True)
    add_prompt_args(ev)
    ev.add_argument("--block-size", type=int, default=None)
    ev.add_argument("--sub-block-size", type=int, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        return run_train(module, args, train_synthetic_dllm, ("layout", "out", "steps", "seed"))
    import torch

    torch.set_num_threads(1)
    rows = evaluate_fast_dllm(args.model, num_prompts=args.prompts, seed=args.seed,
                              max_tokens=args.max_tokens, block_size=args.block_size,
                              sub_block_size=args.sub_block_size)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
