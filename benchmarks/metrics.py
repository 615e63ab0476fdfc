"""Shared benchmark metrics: one definition each, used by every adapter.

Vocabulary (the project's): a *step* is one draft -> verify -> accept -> commit cycle;
*acceptance length* is the mean number of tokens a step commits (accepted drafts + the
recovered / bonus token) = 1 + accepted drafts / verify steps, read from the engine's own
counters; *TPF* is generated tokens / forwards after the prefill (a self-speculative step,
Orthrus or NLD linear, is two forwards: draft + verify); *lossless* is the fraction of
prompts whose greedy output equals the same engine's AR output token for token.

Adapters fill one :class:`RunResult` per baseline; :func:`summarize` turns it into the
report row. No torch, no engine import here.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Completion:
    """One prompt's output at concurrency 1 (requests served one after the other)."""

    token_ids: list[int]  # [num_generated]
    latency_s: float  # request sent -> last token
    ttft_s: float | None = None  # request sent -> first token (None: the adapter cannot see it)
    drafts: int = 0  # verify steps with drafts (engine counter delta)
    draft_tokens: int = 0  # drafts proposed (engine counter delta)
    accepted: int = 0  # drafts accepted (engine counter delta)
    forwards: int | None = None  # forwards after prefill, when the adapter knows them


@dataclass
class RunResult:
    """Everything one baseline produced on one engine."""

    engine: str  # "reference", "vllm", "openai"
    baseline: str  # "ar", "ngram", "orthrus", "eagle3", ...
    launch: dict[str, Any]  # the exact engine / decoder configuration
    completions: list[Completion]  # [num_prompts], concurrency-1 pass, prompt order
    system_tokens_per_s: dict[int, float] = field(default_factory=dict)  # concurrency -> tok/s
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_spec_tokens] counter
    forwards_per_step: int = 1  # forwards per verify step (self-spec: 2, ngram / AR: 1)
    notes: list[str] = field(default_factory=list)
    error: str | None = None  # the engine failed: no completions, the error instead


def acceptance_length(drafts: int, accepted: int) -> float | None:
    """1 + accepted / drafts (``vllm bench serve``'s definition); None without any draft."""
    return 1.0 + accepted / drafts if drafts else None


def tpf(tokens: int, forwards: int | None) -> float | None:
    """Tokens per forward (None when forwards are unknown or zero)."""
    return tokens / forwards if forwards else None


def exact_match_rate(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Fraction of prompts whose output equals the reference output token for token."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs vs {len(reference)} reference outputs")
    return sum(a == b for a, b in zip(outputs, reference)) / max(1, len(outputs))


def acceptance_per_position(accepted_per_pos: list[int], drafts: int) -> list[float]:
    """P(draft i accepted) = accepted at position i / verify steps (cumulative: a draft is
    only accepted when every draft before it was)."""
    return [a / drafts for a in accepted_per_pos] if drafts else []


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _group_stats(completions: list[Completion]) -> dict[str, Any]:
    tokens = sum(len(c.token_ids) for c in completions)
    drafts = sum(c.drafts for c in completions)
    accepted = sum(c.accepted for c in completions)
    forwards = [c.forwards for c in completions]
    known = None if any(f is None for f in forwards) else sum(forwards)  # type: ignore[arg-type]
    ttft = [c.ttft_s for c in completions if c.ttft_s is not None]
    tpot = [(c.latency_s - c.ttft_s) / (len(c.token_ids) - 1) for c in completions
            if c.ttft_s is not None and len(c.token_ids) > 1]
    latency = sum(c.latency_s for c in completions)
    return {
        "num_prompts": len(completions),
        "tokens": tokens,
        "acceptance_length": acceptance_length(drafts, accepted),
        "tpf": tpf(tokens, known),
        "per_user_tokens_per_s": tokens / latency if latency > 0 else None,
        "ttft_s": _mean(ttft),
        "tpot_s": _mean(tpot),
        "drafts": drafts,
        "draft_tokens": sum(c.draft_tokens for c in completions),
        "accepted": accepted,
    }


def summarize(run: RunResult, categories: list[str], ar: RunResult | None) -> dict[str, Any]:
    """The report entry of one baseline: overall and per-category metrics, system tok/s per
    concurrency, and the lossless column against ``ar`` (the same engine's AR run)."""
    outputs = [c.token_ids for c in run.completions]
    ar_outputs = None if ar is None or ar.error else [c.token_ids for c in ar.completions]
    if run.error:
        return _failed_entry(run, categories)
    lossless = None if ar_outputs is None else exact_match_rate(outputs, ar_outputs)
    per_category = {}
    for category in dict.fromkeys(categories):
        idx = [i for i, c in enumerate(categories) if c == category]
        row = _group_stats([run.completions[i] for i in idx])
        if ar_outputs is not None:
            row["lossless"] = exact_match_rate([outputs[i] for i in idx],
                                               [ar.completions[i].token_ids for i in idx])
        per_category[category] = row
    overall = _group_stats(run.completions)
    drafts = overall["drafts"]
    return {
        "engine": run.engine,
        "baseline": run.baseline,
        "launch": run.launch,
        "overall": {**overall, "lossless": lossless},
        "per_category": per_category,
        "system_tokens_per_s": {str(c): v for c, v in sorted(run.system_tokens_per_s.items())},
        "acceptance_per_position": acceptance_per_position(run.accepted_per_pos, drafts),
        "forwards_per_step": run.forwards_per_step,
        "notes": run.notes,
        "outputs": outputs,
        "error": None,
    }


def _failed_entry(run: RunResult, categories: list[str]) -> dict[str, Any]:
    """The report entry of a baseline whose engine failed: the structure of a good one,
    every figure None, the error kept."""
    empty = {**_group_stats([]), "num_prompts": 0, "lossless": None}
    return {
        "engine": run.engine, "baseline": run.baseline, "launch": run.launch,
        "overall": dict(empty), "per_category": {c: dict(empty) for c in dict.fromkeys(categories)},
        "system_tokens_per_s": {}, "acceptance_per_position": [],
        "forwards_per_step": run.forwards_per_step, "notes": run.notes, "outputs": [],
        "error": run.error,
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(entries: list[dict[str, Any]]) -> str:
    """One row per (engine, baseline): the speed figures with the lossless column beside."""
    concurrencies = sorted({int(c) for e in entries for c in e["system_tokens_per_s"]})
    head = ["engine", "baseline", "prompts", "tokens", "acc. len", "TPF", "tok/s/user (c=1)",
            "TTFT ms", "TPOT ms", *[f"sys tok/s c={c}" for c in concurrencies], "lossless"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        o = e["overall"]
        if e.get("error"):
            first = e["error"].splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {e['engine']} | {e['baseline']} | failed: {first} |"
                         + " |" * (len(head) - 3))
            continue
        ms = [None if o[k] is None else o[k] * 1000 for k in ("ttft_s", "tpot_s")]
        row = [e["engine"], e["baseline"], o["num_prompts"], o["tokens"],
               _fmt(o["acceptance_length"]), _fmt(o["tpf"]), _fmt(o["per_user_tokens_per_s"], 1),
               _fmt(ms[0], 1), _fmt(ms[1], 1),
               *[_fmt(e["system_tokens_per_s"].get(str(c)), 1) for c in concurrencies],
               _fmt(o["lossless"])]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines)


def category_table(entries: list[dict[str, Any]]) -> str:
    """Acceptance length and lossless rate per category, one column per baseline."""
    names = [f"{e['engine']}/{e['baseline']}" for e in entries]
    categories = list(dict.fromkeys(c for e in entries for c in e["per_category"]))
    lines = ["| category | " + " | ".join(f"{n} acc. len (lossless)" for n in names) + " |",
             "|" + "---|" * (len(names) + 1)]
    for category in categories:
        cells = []
        for e in entries:
            row = e["per_category"].get(category, {})
            cells.append(f"{_fmt(row.get('acceptance_length'))} ({_fmt(row.get('lossless'))})")
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

