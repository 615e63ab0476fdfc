"""Real-text training corpora that every machine already has, for distilling drafters.

Design notes: docs/design/training.md (section ``diffspec/train/corpora.py``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "chat_prompts",
    "numpy_documents",
    "pydoc_documents",
    "stdlib_documents",
    "text_documents",
    "write_corpus",
]

_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages",
              "lib2to3", "ensurepip", "__pycache__", "config-3", "encodings"}


def _python_files(root: Path) -> list[Path]:
    """``*.py`` under ``root`` in sorted order, skipping test / GUI / vendored folders."""
    return sorted(p for p in root.rglob("*.py")
                  if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS)
                  and not any(part.startswith(("config-", "test_")) for part in p.parts[-2:]))


def stdlib_documents(max_chars: int = 4000) -> Iterator[str]:
    """The standard library's modules, one document each (first ``max_chars`` chars)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _python_files(root):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) > 200:
            yield text[:max_chars]


def pydoc_documents(max_chars: int = 4000) -> Iterator[str]:
    """The documentation topics shipped with Python, sorted by topic name."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        for start in range(0, len(text), max_chars):  # long topics become several documents
            yield text[start:start + max_chars]


def numpy_documents(max_chars: int = 4000) -> Iterator[str]:
    """numpy's Python sources (tests left out), if numpy is installed."""
    try:
        import numpy
    except ImportError:
        return
    root = Path(numpy.__file__).parent
    for path in _python_files(root):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) > 200:
            yield text[:max_chars]


def text_documents(count: int, seed: int = 0, max_chars: int = 4000) -> list[dict[str, str]]:
    """``count`` text documents, a third from each source (each source subsampled with a
    fixed hash of its index so the pick spreads over the whole source)."""
    sources = {"stdlib": list(stdlib_documents(max_chars)),
               "pydoc": list(pydoc_documents(max_chars)),
               "numpy": list(numpy_documents(max_chars))}
    sources = {k: v for k, v in sources.items() if v}
    per_source = -(-count // len(sources))
    picked = []
    for name, docs in sources.items():
        picked += [{"source": name, "text": d} for d in _spread(docs, per_source, seed)]
    return picked[:count]


def chat_prompts(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` user requests: two thirds from stdlib functions with a docstring (the
    signature and docstring as a stub to complete, or a request to explain it), one third
    from pydoc topics (explain a language feature)."""
    stubs: list[tuple[str, str]] = []  # (stub, qualified name)
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _python_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 40 <= len(doc) <= 600:
                    stubs.append((_stub(node, doc), f"{module}.{node.name}"))
    from pydoc_data.topics import topics

    topic_names = sorted(topics)
    n_code = count * 2 // 3
    prompts = []
    for i, (stub, name) in enumerate(_spread(stubs, n_code, seed)):
        if i % 2 == 0:
            prompts.append({"source": "stdlib-stub", "prompt": stub})
        else:
            prompts.append({"source": "stdlib-explain",
                            "prompt": f"Explain what the Python function `{name}` does and "
                                      f"show an example.\n\n```python\n{stub}```"})
    for name in _spread(topic_names, count - n_code, seed):
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if p.strip()]
        title = paragraphs[0].splitlines()[0]
        body = next((p for p in paragraphs[1:] if len(p) > 80), "")[:400]
        prompts.append({"source": "pydoc-explain",
                        "prompt": f"Explain \"{title}\" in Python with a short example. "
                                  f"From the reference:\n\n{body}"})
    return prompts


def _stub(node: ast.FunctionDef, doc: str) -> str:
    """``def name(args):`` plus the indented docstring, as HumanEval-style stubs look."""
    args = ast.unparse(node.args)
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    return f'def {node.name}({args}):\n    """{body.lstrip()}\n    """\n'


def _spread(items: list[Any], count: int, seed: int) -> list[Any]:
    """``count`` items picked by a fixed hash of (seed, index), kept in source order."""
    keyed = sorted(range(len(items)),
                   key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    return [items[i] for i in sorted(keyed[:count])]


# --------------------------------------------------------------------------- writing


def answer_prompts(base: str | Path, prompts: list[str], *, max_new_tokens: int = 192,
                   batch_size: int = 16, num_threads: int | None = None,
                   log=print) -> list[list[int]]:
    """Token ids ``chat(prompt) + greedy answer`` for each prompt, from the model at
    ``base`` (fp32, transformers, left-padded batches of similar length). The answer stops
    at the model's EOS (kept) or after ``max_new_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    encoded = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                       add_generation_prompt=True, return_dict=True)["input_ids"]
               for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    rows: list[list[int] | None] = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(encoded[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(encoded[i])) + list(encoded[i]) for i in idx])
        attn = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i])
                             for i in idx])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos,
                                 pad_token_id=pad)
        for row, i in zip(out[:, width:].tolist(), idx):
            answer = row[:row.index(eos) + 1] if eos in row else row
            rows[i] = list(encoded[i]) + answer
        log(f"answered {min(start + batch_size, len(order))}/{len(order)}")
    return [r for r in rows if r is not None]


def write_corpus(base: str | Path, out: str | Path, *, chat: int, text: int, seed: int = 0,
                 max_new_tokens: int = 192, max_chars: int = 4000, batch_size: int = 16,
                 num_threads: int | None = None, log=print) -> dict[str, Any]:
    """Write the training JSONL: ``chat`` self-answered chat rows (``token_ids``) and
    ``text`` text rows, shuffled with ``seed``; returns a summary (counts per source)."""
    prompts = chat_prompts(chat, seed)
    answered = answer_prompts(base, [p["prompt"] for p in prompts],
                              max_new_tokens=max_new_tokens, batch_size=batch_size,
                              num_threads=num_threads, log=log)
    rows = [{"source": p["source"], "token_ids": ids} for p, ids in zip(prompts, answered)]
    rows += text_documents(text, seed, max_chars)
    random.Random(seed).shuffle(rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["source"]] = counts.get(row["source"], 0) + 1
    summary = {"rows": len(rows), "per_source": counts, "seed": seed,
               "max_new_tokens": max_new_tokens,
               "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    log(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m diffspec.train.corpora",
                                description="Write a drafter-training JSONL from the text on "
                                            "this machine (see the module docstring).")
    p.add_argument("--base", required=True, help="the AR checkpoint that answers the prompts")
    p.add_argument("--out", required=True, help="JSONL to write")
    p.add_argument("--chat", type=int, default=640, help="self-answered chat rows")
    p.add_argument("--text", type=int, default=320, help="plain text rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-chars", type=int, default=4000, help="text documents are cut here")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = default)")
    args = p.parse_args(argv)
    write_corpus(args.base, args.out, chat=args.chat, text=args.text, seed=args.seed,
                 max_new_tokens=args.max_new_tokens, max_chars=args.max_chars,
                 batch_size=args.batch_size,
                 num_threads=args.num_threads or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
