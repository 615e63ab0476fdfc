"""A deterministic synthetic language and a tiny Qwen3 trained on it in a few CPU minutes.

Design notes: docs/design/testing.md (section ``diffspec/testing/synthetic.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
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


def packed_tokens(rng: random.Random, token_ids: dict[str, int], n: int) -> list[int]:
    """``n`` token ids of documents sampled from ``rng`` and packed, starting at a document
    start (the last document is cut)."""
    row: list[int] = []
    while len(row) < n:
        row += [token_ids[w] for w in _sample_document(rng)]
    return row[:n]


def vocabulary_ids() -> dict[str, int]:
    """Token -> id of :func:`vocabulary`."""
    return {t: i for i, t in enumerate(vocabulary())}


def _batch(rng: random.Random, token_ids: dict[str, int], cfg: TrainConfig):
    """[batch, seq_len] rows; every row starts at a document start and packs documents."""
    import torch

    rows = [packed_tokens(rng, token_ids, cfg.seq_len) for _ in range(cfg.batch_size)]
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
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    cfg = TrainConfig(steps=steps, seed=seed, **overrides)
    out = Path(out_dir)
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(model_config(cfg)).float()
    vocab = vocabulary_ids()
    rng = random.Random(cfg.seed)
    result = fit_synthetic(
        model, lambda: _batch(rng, vocab, cfg), cfg,
        loss_fn=lambda m, input_ids: m(input_ids=input_ids, labels=input_ids).loss,
        lr_schedule=warmup_cosine_lr(cfg), log_every=log_every,
    )
    losses = [h["loss"] for h in result.history]

    model.eval()
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.generation_config = GenerationConfig(
        eos_token_id=[vocab[t] for t in EOS_TOKENS], pad_token_id=vocab[ENDOFTEXT]
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_synthetic_tokenizer(out, cfg.max_position_embeddings)

    record = {
        "command": command or f"python -m diffspec.testing.synthetic train --out {out_dir} "
        f"--steps {cfg.steps} --seed {cfg.seed}",
        "seed": cfg.seed,
        "steps": cfg.steps,
        "final_loss": round(losses[-1], 4),
        "final_loss_mean_last_20": tail_means(result.history, 20)["loss"],
        "wall_time_s": round(result.wall_time_s, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "config": cfg.__dict__,
        "torch": torch.__version__,
    }
    (out / "TRAINING.md").write_text(_training_md(record))
    return write_record(out, record)


# ------------------------------------------------- the synthetic trainers' shared pieces


def warmup_cosine_lr(cfg: Any, floor: float = 0.1) -> Callable[[int], float]:
    """The LR of each step: linear warmup over ``cfg.warmup`` steps (``lr * (step + 1) /
    warmup``), then cosine from ``cfg.lr`` down to ``floor * cfg.lr`` at ``cfg.steps``
    (synth-qwen3, synth-dllm). ``cfg`` is any synthetic trainer config (``lr``,
    ``warmup``, ``steps``)."""

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))

    return lr_at


def warmup_cosine_to_zero_lr(cfg: Any) -> Callable[[int], float]:
    """The LR of each step: ``lr * min((step + 1) / warmup, 0.5 (1 + cos(pi step /
    steps)))``, a cosine to 0 over the whole run, cut by the linear warmup at the start
    (synth-refusion, synth-tidar)."""

    def lr_at(step: int) -> float:
        warm = (step + 1) / cfg.warmup
        decay = 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        return cfg.lr * min(warm, decay)

    return lr_at


def fit_synthetic(
    model,  # torch.nn.Module: every parameter that requires grad trains
    next_batch: Callable[[], Any],  # the next training batch (called once per step)
    cfg: Any,  # a synthetic trainer config: steps, seed, lr, warmup, weight_decay, ...
    *,
    loss_fn: Callable[[Any, Any], Any],  # (model, batch) -> loss tensor or dict with "loss"
    lr_schedule: Callable[[int], float],
    log_every: int = 50,  # 0: silent
):
    """The optimization loop of the synthetic checkpoints' trainers: :func:`diffspec.train.fit`
    as one plain process (no ``accelerate``), AdamW betas (0.9, 0.95) with ``cfg.lr`` /
    ``cfg.weight_decay``, gradient clipping at 1.0, ``cfg.num_threads`` torch threads,
    the global torch RNG seeded with ``cfg.seed``. Returns the
    :class:`~diffspec.train.FitResult`."""
    from diffspec.train import TrainConfig as FitConfig
    from diffspec.train import fit

    fit_cfg = FitConfig(
        steps=cfg.steps, lr=cfg.lr, warmup_steps=cfg.warmup, weight_decay=cfg.weight_decay,
        betas=(0.9, 0.95), max_grad_norm=1.0, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
        seed=cfg.seed, num_threads=cfg.num_threads, log_every=log_every or cfg.steps,
    )
    batches = (next_batch() for _ in range(cfg.steps))
    return fit(model, batches, fit_cfg, loss_fn=loss_fn, lr_schedule=lr_schedule,
               use_accelerate=False, log=None if log_every else (lambda msg: None))


def tail_means(history: list[dict[str, float]], n: int,
               keys: tuple[str, ...] = ("loss",)) -> dict[str, float]:
    """Each of ``keys`` averaged over the last ``n`` steps of a fit history, to 4 places."""
    tail = history[-n:]
    return {k: round(sum(h[k] for h in tail) / len(tail), 4) for k in keys}


def fine_tune_qwen3(
    out_dir: str | Path,
    base: str | Path | None,  # a Qwen3 checkpoint; None: the bundled synth-qwen3
    cfg: Any,  # a synthetic trainer config (see fit_synthetic)
    next_batch: Callable[[], Any],
    loss_fn: Callable[[Any, Any], Any],
    config: dict[str, Any],  # set on the saved model's config (e.g. mask_token_id)
    **load_kwargs: Any,  # for from_pretrained (e.g. attn_implementation)
):
    """Fine-tune all weights of the fp32 Qwen3 ``base`` by :func:`fit_synthetic` with
    :func:`warmup_cosine_to_zero_lr` (synth-refusion, synth-tidar), then save it to
    ``out_dir`` with ``config`` added to its config.json and the base's tokenizer and
    generation config. Returns ``(base folder, FitResult)``."""
    import shutil

    import torch
    from transformers import Qwen3ForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR

    base, out = Path(base or SYNTH_QWEN3_DIR), Path(out_dir)
    model = Qwen3ForCausalLM.from_pretrained(str(base), dtype=torch.float32, **load_kwargs)
    result = fit_synthetic(model, next_batch, cfg, loss_fn=loss_fn,
                           lr_schedule=warmup_cosine_to_zero_lr(cfg))
    model.eval()
    for key, value in config.items():
        setattr(model.config, key, value)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, out / name)
    return base, result


def write_record(out_dir: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write a trainer's record to ``out_dir/training.json``; returns it."""
    (Path(out_dir) / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


# ------------------------------------------- the synthetic models' measurement and CLI


def prompt_requests(num_prompts: int, seed: int, max_tokens: int,
                       stop_token_ids: tuple[int, ...], **kwargs: Any) -> list:
    """One :class:`~diffspec.spec_workers.reference.decoder.Request` per
    ``sample_prompts(num_prompts, seed)`` prompt (``kwargs``: more Request fields)."""
    from diffspec.spec_workers.reference.decoder import Request

    tok = build_tokenizer()
    return [Request(tok(p)["input_ids"], max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                    **kwargs) for p in sample_prompts(num_prompts, seed)]


def decode_summary(outs: list, wall: float) -> dict[str, Any]:
    """Tokens, forwards, TPF, draft acceptance (accepted / verified drafts), requests that
    stopped on a stop token, and wall time of a decoder's outputs."""
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.num_forwards for o in outs)
    return {
        "tokens": tokens,
        "forwards": forwards,
        "tpf": round(tokens / forwards, 3),
        "draft_acceptance": round(sum(o.num_accepted_tokens for o in outs)
                                  / max(1, sum(o.num_draft_tokens for o in outs)), 3),
        "stopped": sum(o.finish_reason == "stop" for o in outs),
        "wall_s": round(wall, 2),
    }




def trainer_cli(module: str, train_help: str, cfg: Any, description: str | None = None):
    """``(parser, subparsers, train)``: the CLI of a synthetic trainer module
    (``python -m <module>``) with its ``train`` command (``--out``, ``--steps`` and
    ``--seed``, defaults from the config class ``cfg``); callers add their own options and
    commands, then :func:`run_train`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help=train_help)
    train.add_argument("--out", required=True, help="output checkpoint folder")
    train.add_argument("--steps", type=int, default=cfg.steps)
    train.add_argument("--seed", type=int, default=cfg.seed)
    return parser, sub, train


def run_train(module: str, args: argparse.Namespace, train: Callable[..., dict[str, Any]],
              options: tuple[str, ...] = ("out", "steps", "seed")) -> int:
    """Run a ``train`` command: ``train(args.out, command=..., **options)``, the command
    line recorded with ``options`` in that order; prints the record without its config."""
    command = f"python -m {module} train " + " ".join(
        f"--{name.replace('_', '-')} {getattr(args, name)}" for name in options)
    record = train(args.out, command=command,
                   **{name: getattr(args, name) for name in options if name != "out"})
    print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2))
    return 0


def add_prompt_args(parser: argparse.ArgumentParser, prompts: int = 16) -> None:
    """``--prompts`` / ``--seed`` (of ``sample_prompts``) / ``--max-tokens`` of an eval."""
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--seed", type=int, default=1, help="sample_prompts seed")
    parser.add_argument("--max-tokens", type=int, default=64)


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


# ------------------------------------------------------------ measurement (reference decoder)


def synthetic_eval_prompts(
    tokenizer,
    *,
    num: int = 16,
    seed: int = 1234,
    doc_seed: int = 4321,
    prefix_tokens: int = 24,
    text: Callable[[str], str] = lambda s: s,
) -> dict[str, list[list[int]]]:
    """Two prompt sets of the synthetic language: ``sample_prompts(num, seed)`` and the first
    ``prefix_tokens`` tokens of held-out documents (``sample_documents(.., doc_seed)``, a
    stream the trainers never draw from). ``text`` maps the text into a tokenizer's terms."""
    def ids(s: str) -> list[int]:
        return list(tokenizer(text(s), add_special_tokens=False)["input_ids"])

    docs = [d for d in map(ids, sample_documents(8 * num, doc_seed)) if len(d) > prefix_tokens + 16]
    return {
        f"sample_prompts({num}, seed={seed})": [ids(p) for p in sample_prompts(num, seed)],
        f"heldout_documents(seed={doc_seed})[:{prefix_tokens}]":
            [d[:prefix_tokens] for d in docs[:num]],
    }


def measure_on_synthetic(
    lm, drafter, num_draft_tokens: int, tokenizer=None, **prompt_kwargs: Any
) -> dict[str, dict[str, Any]]:
    """:func:`measure_speculation` on both :func:`synthetic_eval_prompts` sets (default
    tokenizer: the synthetic language's)."""
    from diffspec.train import measure_speculation

    if tokenizer is None:
        tokenizer = build_tokenizer()
    return {name: measure_speculation(lm, drafter, prompts, num_draft_tokens)
            for name, prompts in synthetic_eval_prompts(tokenizer, **prompt_kwargs).items()}


def main(argv: list[str] | None = None) -> int:
    module = "diffspec.testing.synthetic"
    parser, sub, _ = trainer_cli(module, "train the synthetic Qwen3 and save it", TrainConfig,
                                 "Synthetic language for diffspec: train the tiny Qwen3 or "
                                 "print samples.")
    sample = sub.add_parser("sample", help="print sampled documents")
    sample.add_argument("-n", type=int, default=5)
    sample.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "train":
        return run_train(module, args, train_synthetic_model)
    print("\n".join(sample_documents(args.n, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
