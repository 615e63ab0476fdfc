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
# SPEED-Bench's row fields (qualitative split: 11 categories; ``turns[0]`` is the prompt)
SPEED_BENCH_FIELDS = ("question_id", "category", "sub_category", "turns", "source", "src_id",
                      "difficulty", "multiturn")


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


def load_prompts(dataset: str, path: str | Path | None, num_prompts: int | None = None,
                 categories: list[str] | None = None) -> list[Prompt]:
    """Load ``num_prompts`` prompts (all when None; SPEED-Bench: spread evenly over its
    categories, in file order within each) from ``path`` (default: the shared data copy)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r} (known: {', '.join(DATASETS)})")
    if path is None:
        if dataset not in DEFAULT_PATHS:
            raise ValueError(f"--data-path is required for dataset {dataset!r}")
        path = DEFAULT_PATHS[dataset]
    path = Path(path)
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
        missing = [f for f in ("question_id", "category", "turns") if f not in rows[0]]
        if missing:
            raise ValueError(f"{path}: not SPEED-Bench rows (missing {missing}; expected "
                             f"fields {', '.join(SPEED_BENCH_FIELDS)})")
        prompts = [Prompt(r["turns"][0], r["category"], str(r["question_id"])) for r in rows]
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
