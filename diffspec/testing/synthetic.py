"""A deterministic synthetic language and a tiny Qwen3 trained on it in a few CPU minutes.

The language is built so that drafts are often right, which makes speculative decoding
visible on a laptop:

* a **vocabulary** of 200 pronounceable two-syllable words (``"bako"``, ``"tirum"``),
  plus ``user`` / ``assistant`` / ``system`` so a chat template renders;
* a fixed **phrasebook** of 48 phrases of 4-12 words; every phrase has a unique first word,
  so once a phrase has started, the rest of it is determined;
* a **successor** map: a permutation of the phrases made of cycles of 3-4 phrases. After a
  phrase, the next one is ``successor[p]`` with probability 0.8, else a uniformly random one;
* a **document** is 3-12 phrases (uniform) followed by ``<|endoftext|>``; about one document in
  five is a chat turn instead::

      <|im_start|> user <phrase> <|im_end|> <|im_start|> assistant <1-4 phrases> <|im_end|>
      <|endoftext|>

Special tokens (ids 0-3, in this order): ``<|endoftext|>`` ends a plain document and is the
tokenizer's ``eos_token`` (and pad token); ``<|im_end|>`` ends a chat turn. Both are listed in
``generation_config.eos_token_id``, so both stop generation. ``<|mask|>`` is the mask token the
diffusion view fills in; the AR model never sees it in training.

Because the successor cycles are short, a continuation usually repeats phrases that are already
in the prompt, so even a prompt-lookup (n-gram) drafter gets long accepted runs.

The language itself is fixed (:data:`LANGUAGE_SEED`); the ``seed`` arguments below only choose
which documents are sampled and how the model is initialised.

CLI::

    python -m diffspec.testing.synthetic train --out DIR [--steps N --seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

LANGUAGE_SEED = 0
NUM_WORDS = 200
NUM_PHRASES = 48
PHRASE_LEN = (4, 12)  # inclusive
CYCLE_LEN = (3, 4)  # inclusive
P_SUCCESSOR = 0.8
DOC_PHRASES = (3, 12)  # inclusive
P_CHAT = 0.2

ENDOFTEXT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)
ROLE_WORDS = ("user", "assistant", "system")
EOS_TOKENS = (ENDOFTEXT, IM_END)  # both stop generation (generation_config.eos_token_id)

_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_CODAS = ("", "", "", "n", "m", "r", "s", "l")


@dataclass(frozen=True)
class Language:
    """The fixed word list, phrasebook and successor map."""

    words: tuple[str, ...]  # [NUM_WORDS], role words excluded
    phrases: tuple[tuple[str, ...], ...]  # [NUM_PHRASES][4..12]
    successor: tuple[int, ...]  # [NUM_PHRASES], a permutation made of short cycles


@lru_cache(maxsize=1)
def language() -> Language:
    """Build the language from :data:`LANGUAGE_SEED` (pure, cached)."""
    rng = random.Random(LANGUAGE_SEED)
    words: list[str] = []
    seen = set(ROLE_WORDS)
    while len(words) < NUM_WORDS:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2))
        w += rng.choice(_CODAS)
        if w not in seen:
            seen.add(w)
            words.append(w)

    first_words = rng.sample(words, NUM_PHRASES)  # unique first word per phrase
    phrases = []
    for first in first_words:
        length = rng.randint(*PHRASE_LEN)
        phrases.append((first, *(rng.choice(words) for _ in range(length - 1))))

    order = list(range(NUM_PHRASES))
    rng.shuffle(order)
    successor = [0] * NUM_PHRASES
    i = 0
    while i < NUM_PHRASES:
        size = rng.randint(*CYCLE_LEN)
        if NUM_PHRASES - (i + size) < CYCLE_LEN[0]:  # last cycle takes the rest
            size = NUM_PHRASES - i
        cycle = order[i : i + size]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            successor[a] = b
        i += size
    return Language(tuple(words), tuple(phrases), tuple(successor))


def vocabulary() -> list[str]:
    """All tokens in id order: specials, ``<unk>``, role words, then the words."""
    return [*SPECIAL_TOKENS, "<unk>", *ROLE_WORDS, *language().words]


def build_tokenizer():
    """The word-level ``PreTrainedTokenizerFast`` of the language (specials get ids 0-3)."""
    from diffspec.testing.tokenizer import CHAT_TEMPLATE, build_word_tokenizer

    tok = build_word_tokenizer([*ROLE_WORDS, *language().words], SPECIAL_TOKENS)
    tok.eos_token, tok.pad_token, tok.mask_token = ENDOFTEXT, ENDOFTEXT, MASK
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_synthetic_tokenizer(path: str | Path, model_max_length: int) -> None:
    """Save the tokenizer; the chat template goes inside ``tokenizer_config.json`` (no
    separate ``chat_template.jinja``, so the folder is only json / safetensors / md files)."""
    from diffspec.testing.tokenizer import save_tokenizer

    path = Path(path)
    save_tokenizer(
        build_tokenizer(),
        path,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        model_max_length=model_max_length,
    )
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = jinja.read_text()
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        jinja.unlink()


def _phrase_chain(rng: random.Random, num_phrases: int, first: int | None = None) -> list[int]:
    lang = language()
    p = rng.randrange(NUM_PHRASES) if first is None else first
    chain = [p]
    while len(chain) < num_phrases:
        p = lang.successor[p] if rng.random() < P_SUCCESSOR else rng.randrange(NUM_PHRASES)
        chain.append(p)
    return chain


def _words(chain: list[int]) -> list[str]:
    phrases = language().phrases
    return [w for p in chain for w in phrases[p]]


def _sample_document(rng: random.Random) -> list[str]:
    if rng.random() < P_CHAT:
        user = _phrase_chain(rng, 1)
        reply = _phrase_chain(rng, rng.randint(1, 4), first=language().successor[user[0]])
        return [IM_START, "user", *_words(user), IM_END,
                IM_START, "assistant", *_words(reply), IM_END, ENDOFTEXT]
    return [*_words(_phrase_chain(rng, rng.randint(*DOC_PHRASES))), ENDOFTEXT]


def sample_documents(n: int, seed: int) -> list[str]:
    """``n`` documents as whitespace-joined text, each ending with ``<|endoftext|>``."""
    rng = random.Random(seed)
    return [" ".join(_sample_document(rng)) for _ in range(n)]


def sample_prompts(n: int, seed: int, num_phrases: tuple[int, int] = (4, 6)) -> list[str]:
    """``n`` plain-text prompts: 4-6 phrases that follow the successor cycle from a random
    phrase, plus the first word of the next one. Such a prompt has seen its whole cycle, so
    the likely continuation repeats it (what prompt lookup needs to be accepted)."""
    lang = language()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        chain = [rng.randrange(NUM_PHRASES)]
        for _ in range(rng.randint(*num_phrases)):
            chain.append(lang.successor[chain[-1]])
        prompts.append(" ".join(_words(chain[:-1]) + [lang.phrases[chain[-1]][0]]))
    return prompts


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 192
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    num_threads: int = 1  # fixed, so the run is bit-reproducible on any machine
    hidden_size: int = 128
    intermediate_size: int = 320
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention rejects head_dim 16
    max_position_embeddings: int = 512


def model_config(cfg: TrainConfig):
    """The ``Qwen3Config`` of the synthetic model."""
    from transformers import Qwen3Config

    tok = build_tokenizer()
    eos_ids = [tok.convert_tokens_to_ids(t) for t in EOS_TOKENS]
    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=eos_ids[0],
        dtype="float32",
    )


def _batch(rng: random.Random, token_ids: dict[str, int], cfg: TrainConfig):
    """[batch, seq_len] rows; every row starts at a document start and packs documents."""
    import torch

    rows = []
    for _ in range(cfg.batch_size):
        row: list[int] = []
        while len(row) < cfg.seq_len:
            row += [token_ids[w] for w in _sample_document(rng)]
        rows.append(row[: cfg.seq_len])
    return torch.tensor(rows, dtype=torch.long)  # [batch, seq_len]


def train_synthetic_model(
    out_dir: str | Path,
    *,
    steps: int = TrainConfig.steps,
    seed: int = TrainConfig.seed,
    log_every: int = 50,
    command: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train the synthetic Qwen3 from scratch and save a normal HF checkpoint to ``out_dir``
    (fp32 ``model.safetensors``, config, generation config, tokenizer, ``TRAINING.md`` and
    ``training.json``). Deterministic given ``seed``. Returns the training record."""
    import math

    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    cfg = TrainConfig(steps=steps, seed=seed, **overrides)
    out = Path(out_dir)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(model_config(cfg)).float()
        model.train()
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )

        def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
            if step < cfg.warmup:
                return cfg.lr * (step + 1) / cfg.warmup
            t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

        vocab = {t: i for i, t in enumerate(vocabulary())}
        rng = random.Random(cfg.seed)
        losses: list[float] = []
        start = time.perf_counter()
        for step in range(cfg.steps):
            input_ids = _batch(rng, vocab, cfg)  # [batch, seq_len]
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = model(input_ids=input_ids, labels=input_ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == cfg.steps - 1):
                print(f"step {step:5d}  loss {loss.item():.4f}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(prev_threads)

    model.eval()
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.generation_config = GenerationConfig(
        eos_token_id=[vocab[t] for t in EOS_TOKENS], pad_token_id=vocab[ENDOFTEXT]
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_synthetic_tokenizer(out, cfg.max_position_embeddings)

    tail = losses[-20:]
    record = {
        "command": command or f"python -m diffspec.testing.synthetic train --out {out_dir} "
        f"--steps {cfg.steps} --seed {cfg.seed}",
        "seed": cfg.seed,
        "steps": cfg.steps,
        "final_loss": round(losses[-1], 4),
        "final_loss_mean_last_20": round(sum(tail) / len(tail), 4),
        "wall_time_s": round(wall, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "config": cfg.__dict__,
        "torch": torch.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "TRAINING.md").write_text(_training_md(record))
    return record


def _training_md(r: dict[str, Any]) -> str:
    return f"""# synth-qwen3: a tiny Qwen3 trained on diffspec's synthetic language

Trained from scratch on CPU, deterministically, by:

    {r["command"]}

| field | value |
|---|---|
| seed | {r["seed"]} |
| steps | {r["steps"]} |
| final loss (last step) | {r["final_loss"]} |
| mean loss, last 20 steps | {r["final_loss_mean_last_20"]} |
| wall time | {r["wall_time_s"]} s ({r["config"]["num_threads"]} thread) |
| parameters | {r["num_parameters"]:,} (fp32, tied embeddings) |
| tokens seen | {r["tokens_seen"]:,} |
| torch | {r["torch"]} |

The language (words, phrasebook, successor cycles) is defined in
`diffspec/testing/synthetic.py`. `<|endoftext|>` ends a plain document (tokenizer
`eos_token`), `<|im_end|>` ends a chat turn; both are in `generation_config.eos_token_id`.
`<|mask|>` is reserved for the diffusion view. The loss floor is not zero: phrase boundaries
are random (successor with p=0.8) and so is the document length.

Full record: `training.json`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffspec.testing.synthetic",
        description="Synthetic language for diffspec: train the tiny Qwen3 or print samples.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="train the synthetic Qwen3 and save it")
    train.add_argument("--out", required=True, help="output checkpoint folder")
    train.add_argument("--steps", type=int, default=TrainConfig.steps)
    train.add_argument("--seed", type=int, default=TrainConfig.seed)
    sample = sub.add_parser("sample", help="print sampled documents")
    sample.add_argument("-n", type=int, default=5)
    sample.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        cmd = f"python -m diffspec.testing.synthetic train --out {args.out} "
        cmd += f"--steps {args.steps} --seed {args.seed}"
        record = train_synthetic_model(args.out, steps=args.steps, seed=args.seed, command=cmd)
        print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2))
    else:
        print("\n".join(sample_documents(args.n, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
