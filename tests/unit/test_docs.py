"""The README and docs/ stay readable (scripts/check_docs.py's rules) and say what the code
does: the README's serve command is the vLLM page's, and the methods page names every
method and checkpoint family of the registry."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from diffspec.methods import FAMILIES, diffspec_methods

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
check_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_docs)

EXPECTED_PAGES = {"quickstart", "vllm", "sglang", "methods", "adaptive", "sampling",
                  "training", "benchmarks"}


def test_readme_and_docs_follow_the_rules() -> None:
    found = check_docs.problems(ROOT)
    assert not found, "\n".join(found)


def test_every_page_is_checked_and_listed_in_the_readme() -> None:
    docs = ROOT / "docs"
    files = check_docs.doc_files(ROOT)[1:]
    pages = {p.stem for p in files if p.parent == docs}
    assert EXPECTED_PAGES <= pages
    readme = (ROOT / "README.md").read_text()
    for page in pages:
        assert f"](docs/{page}.md)" in readme, f"README's docs index lacks docs/{page}.md"
    design = [p for p in files if p.parent == docs / "design" and p.name != "README.md"]
    assert design, "docs/design/ holds the modules' design notes"
    index = (docs / "design" / "README.md").read_text()
    for page in design:
        assert f"]({page.name})" in index, f"docs/design/README.md lacks {page.name}"


def _write(root: Path, readme: str, page: str) -> None:
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text(readme)
    (root / "docs" / "page.md").write_text(page)


def test_checker_reports_each_broken_rule(tmp_path: Path) -> None:
    long_cell = "x" * 301
    long_paragraph = " ".join(["word"] * 121)
    readme = "# Title\n\n" + "line\n\n" * 100 + "[ok](docs/page.md#a-heading)\n"
    page = (f"# Page\n\n## A heading\n\n| a | b |\n|---|---|\n| {long_cell} | y |\n"
            f"| one `a|b` | two |\n\n{long_paragraph}\n\n- {long_paragraph}\n\n"
            "[gone](missing.md) [bad anchor](page.md#nowhere) [web](https://example.com)\n\n"
            "`docs/page.md` `docs/{page,gone}.md` `tests/x.py::test_y` `docs/*.md` `other/x.py`\n\n"
            f"```\n{long_paragraph}\n| {long_cell} |\n[in code](missing.md)\n```\n")
    _write(tmp_path, readme, page)
    found = check_docs.problems(tmp_path)
    assert [f for f in found if f.startswith("README.md: 203 lines")]
    expected = ["docs/page.md:7: table cell of 301 characters",
                "docs/page.md:8: table row has 3 cells, its header 2",
                "docs/page.md:10: paragraph of 121 words",
                "docs/page.md:12: paragraph of 121 words",
                "docs/page.md:14: link to a missing file: missing.md",
                "docs/page.md:14: link to a missing heading: page.md#nowhere",
                "docs/page.md:16: names a path that does not exist: docs/gone.md",
                "docs/page.md:16: names a path that does not exist: tests/x.py"]
    for want in expected:
        assert [f for f in found if f.startswith(want)], (want, found)
    assert len(found) == len(expected) + 1, found  # nothing inside the code block, no URL


def test_checker_accepts_the_limits(tmp_path: Path) -> None:
    cell = "x" * 300
    paragraph = " ".join(["word"] * 120)
    readme = "# T\n\n" + "line\n\n" * 98 + "[p](docs/page.md#a-heading-code_x-2)\n"
    page = (f"# P\n\n## A heading: `code_x` (2)\n\n| a | b |\n|---|---|\n| {cell} | `a\\|b` |\n\n"
            f"{paragraph}\n\n[readme](../README.md) [self](#p) [folder](../docs/)\n")
    _write(tmp_path, readme, page)
    assert check_docs.problems(tmp_path) == []


def _first_command(text: str, heading: str) -> str:
    section = text[text.index(heading):]
    block = section[section.index("```bash\n") + 8:]
    return block[:block.index("```")].splitlines()[0]


def test_readme_serve_command_is_the_vllm_pages_first() -> None:
    """The README's vLLM command (checked as written by the engine tier) is the first
    command of docs/vllm.md, so the page cannot drift from the tested line."""
    readme = _first_command((ROOT / "README.md").read_text(), "## Serve")
    page = _first_command((ROOT / "docs" / "vllm.md").read_text(), "## Commands")
    assert readme == page
    assert "--speculative-config" in readme and "--dtype float32" in readme


@pytest.mark.parametrize("name", [m.name for m in diffspec_methods()])
def test_methods_page_describes_every_method(name: str) -> None:
    text = (ROOT / "docs" / "methods.md").read_text()
    assert re.search(rf"^\| `{name}` \|", text, re.M), f"docs/methods.md has no row for {name}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_methods_page_describes_every_family(name: str) -> None:
    text = (ROOT / "docs" / "methods.md").read_text()
    section = text[text.index("## Checkpoint families"):text.index("## The bundled models")]
    assert re.search(rf"^\| `{name}` \|", section, re.M), f"docs/methods.md lacks family {name}"


def test_readme_first_commands_are_what_bootstrap_ci_and_the_cli_provide() -> None:
    """The README's two CPU commands: the venv bootstrap.sh builds by default, the
    ``diffspec`` script and its ``quickstart`` command, and CI's test command."""
    import shlex
    import tomllib

    from diffspec.cli import build_parser

    text = (ROOT / "README.md").read_text()
    block = text[text.index("```bash\n") + 8:]
    setup, test = [line.partition("#")[0].strip() for line in block[:block.index("```")].splitlines()]
    assert setup == "bash scripts/bootstrap.sh && .venv/bin/diffspec quickstart"
    assert test == ".venv/bin/python -m pytest"
    assert 'venv="${1:-.venv}"' in (ROOT / "scripts" / "bootstrap.sh").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["diffspec"] == "diffspec.cli:main"
    assert build_parser().parse_args(["quickstart"]).command == "quickstart"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest " in ci and shlex.split(test)[1:] == ["-m", "pytest"]
