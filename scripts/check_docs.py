#!/usr/bin/env python3
"""Check that README.md and docs/*.md stay readable and their links resolve.

    python scripts/check_docs.py      prints every problem; exit status 1 if there is one

Rules: the README is at most 200 lines; no table cell is over 300 characters; a table row
has as many cells as its header; no paragraph or list item is over 120 words; every
relative link points at an existing file or folder, and a ``#fragment`` at a heading of the
target Markdown file; every repository path named in a code span (``diffspec/...``,
``tests/...``, ``{a,b}`` alternatives and ``*`` globs expanded) exists. Code blocks are not
checked. Standard library only (tests/unit/test_docs.py
runs it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
CELL_MAX_CHARS = 300
PARAGRAPH_MAX_WORDS = 120

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LIST_ITEM = re.compile(r"\s*([-*+]|\d+\.)\s")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_REPO_PATH = re.compile(r"(diffspec|tests|benchmarks|scripts|docs|\.ci)/[\w./{},*-]+")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The README and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: code spans and links to their text, lower case,
    punctuation dropped (``-`` and ``_`` kept), spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def _table_problems(rows: list[tuple[int, str]], name: str) -> list[str]:
    problems = []
    width = None
    for number, line in rows:
        cells = _CELL_SPLIT.split(line.strip().strip("|"))
        if re.fullmatch(r"[\s:|-]+", line):
            continue  # the delimiter row
        if width is None:
            width = len(cells)
        elif len(cells) != width:
            problems.append(f"{name}:{number}: table row has {len(cells)} cells, its header "
                            f"{width} (escape a | inside a cell as \\|)")
        for cell in cells:
            if len(cell.strip()) > CELL_MAX_CHARS:
                problems.append(f"{name}:{number}: table cell of {len(cell.strip())} "
                                f"characters (at most {CELL_MAX_CHARS}): "
                                f"{cell.strip()[:60]}...")
    return problems


def _paragraph_problems(lines: list[tuple[int, str]], name: str) -> list[str]:
    problems = []
    block: list[tuple[int, str]] = []

    def close():
        words = sum(len(_LIST_ITEM.sub("", text, count=1).split()) for _, text in block)
        if words > PARAGRAPH_MAX_WORDS:
            problems.append(f"{name}:{block[0][0]}: paragraph of {words} words (at most "
                            f"{PARAGRAPH_MAX_WORDS}): {block[0][1].strip()[:60]}...")
        block.clear()

    for number, line in lines:
        stripped = line.strip()
        if (not stripped or stripped.startswith(("#", "|", "<!--"))
                or _LIST_ITEM.match(line)):
            close()
            if _LIST_ITEM.match(line):
                block.append((number, line))
            continue
        block.append((number, line))
    close()
    return problems


def _link_problems(path: Path, lines: list[tuple[int, str]], root: Path) -> list[str]:
    problems = []
    name = path.relative_to(root)
    for number, line in lines:
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{name}:{number}: link to a missing file: {target}")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                problems.append(f"{name}:{number}: link to a missing heading: {target}")
    return problems


def _expand(path: str) -> list[str]:
    """``a/{b,c}/d`` -> ``a/b/d``, ``a/c/d``."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [out for alt in match.group(1).split(",")
            for out in _expand(path[:match.start()] + alt + path[match.end():])]


def _path_problems(path: Path, lines: list[tuple[int, str]], root: Path) -> list[str]:
    problems = []
    for number, line in lines:
        for match in _CODE_SPAN.finditer(line):
            named = match.group(2).split("::")[0]  # a pytest id names its file
            if not _REPO_PATH.fullmatch(named):
                continue
            for candidate in _expand(named):
                if not any(root.glob(candidate.rstrip("/"))):
                    problems.append(f"{path.relative_to(root)}:{number}: names a path that "
                                    f"does not exist: {candidate}")
    return problems


def problems(root: Path = ROOT) -> list[str]:
    """Every rule broken in the README and docs/*.md, one line each."""
    out = []
    readme = root / "README.md"
    count = len(readme.read_text().splitlines())
    if count > README_MAX_LINES:
        out.append(f"README.md: {count} lines (at most {README_MAX_LINES}): move detail to docs/")
    for path in doc_files(root):
        name = str(path.relative_to(root))
        lines = prose_lines(path.read_text())
        table: list[tuple[int, str]] = []
        for number, line in [*lines, (0, "")]:
            if line.strip().startswith("|"):
                table.append((number, line))
            elif table:
                out += _table_problems(table, name)
                table = []
        out += _paragraph_problems(lines, name)
        out += _link_problems(path, lines, root)
        out += _path_problems(path, lines, root)
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"{len(doc_files())} files checked, {len(found)} problem(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
