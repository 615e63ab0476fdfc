"""Benchmark prompt sets: GSM8K, HumanEval, SPEED-Bench (local copy) and any JSONL of
prompts. Each loader returns :class:`Prompt` rows (text + category); the data files are
read where they are (``../shared/data`` by default), never copied into the repository."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
DEFAULT_PATHS = {
    "gsm8k": SHARED_DATA / "gsm8k_test.jsonl",
    "humaneval": SHARED_DATA / "HumanEval.jsonl.gz",
}
DATASETS = ("gsm8k", "humaneval", "speed-bench", "jsonl")
# SPEED-Bench's row fields (qualitative split: 11 categories; ``turns[0]`` is the prompt).
# The copy NeMo-Skills' prepare script writes (what ``vllm bench serve --dataset-name
# speed_bench`` reads) is a folder of ``{subset}.jsonl`` whose rows carry ``messages``
# (``messages[0]["content"]`` is the prompt) instead of ``turns``: both are read.
SPEED_BENCH_FIELDS = ("question_id", "category", "sub_category", "turns", "source", "src_id",
                      "difficulty", "multiturn")
SPEED_BENCH_SUBSETS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k",
                       "throughput_16k", "throughput_32k")


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str  # SPEED-Bench category; the dataset name for the others
    id: str


def _read_rows(path: Path) -> list[dict]:
    """JSONL (optionally .gz) or a JSON list of row objects."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _speed_bench_prompt(row: dict, index: int, subset: str) -> Prompt:
    """One SPEED-Bench row (``turns`` or ``messages`` form) as a prompt; throughput rows
    without a category are grouped under their split's name."""
    text = row["turns"][0] if "turns" in row else row["messages"][0]["content"]
    return Prompt(text, row.get("category") or subset, str(row.get("question_id", index)))


def load_prompts(dataset: str, path: str | Path | None, num_prompts: int | None = None,
                 categories: list[str] | None = None,
                 subset: str = "qualitative") -> list[Prompt]:
    """Load ``num_prompts`` prompts (all when None; SPEED-Bench: spread evenly over its
    categories, in file order within each) from ``path`` (default: the shared data copy;
    SPEED-Bench: a file, or a folder holding ``{subset}.jsonl``)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r} (known: {', '.join(DATASETS)})")
    if path is None:
        if dataset not in DEFAULT_PATHS:
            raise ValueError(f"--data-path is required for dataset {dataset!r}")
        path = DEFAULT_PATHS[dataset]
    path = Path(path)
    if dataset == "speed-bench" and path.is_dir():
        if subset not in SPEED_BENCH_SUBSETS:
            raise ValueError(f"unknown SPEED-Bench subset {subset!r} "
                             f"(known: {', '.join(SPEED_BENCH_SUBSETS)})")
        path = path / f"{subset}.jsonl"
    if not path.is_file():
        raise ValueError(f"{dataset}: no file at {path}")
    rows = _read_rows(path)
    if dataset == "gsm8k":
        prompts = [Prompt(r["question"], "gsm8k", f"gsm8k/{i}") for i, r in enumerate(rows)]
    elif dataset == "humaneval":
        prompts = [Prompt(r["prompt"], "humaneval", r["task_id"]) for r in rows]
    elif dataset == "jsonl":
        prompts = [Prompt(r["prompt"], r.get("category", "prompts"), str(r.get("id", i)))
                   for i, r in enumerate(rows)]
    else:
        if not rows or not ("turns" in rows[0] or "messages" in rows[0]):
            raise ValueError(f"{path}: not SPEED-Bench rows (no 'turns' or 'messages'; "
                             f"expected fields {', '.join(SPEED_BENCH_FIELDS)})")
        prompts = [_speed_bench_prompt(r, i, subset) for i, r in enumerate(rows)]
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    if num_prompts is None or num_prompts >= len(prompts):
        return prompts
    if dataset != "speed-bench":
        return prompts[:num_prompts]
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    picked: list[Prompt] = []
    while len(picked) < num_prompts:  # round-robin over categories
        for rows_of in by_category.values():
            if rows_of and len(picked) < num_prompts:
                picked.append(rows_of.pop(0))
    return picked
