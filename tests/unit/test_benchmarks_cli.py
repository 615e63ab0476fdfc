"""``python -m benchmarks VERB``: the one entry point lists every verb with its line, each
verb's ``--help`` runs under the verb's name, reports record the verb's command, and the
documentation's benchmark commands use the verbs (so each still runs as written)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import command_line
from benchmarks.__main__ import VERBS, main

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "results" / "README.md"]


def test_help_lists_every_verb_with_its_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    listed = dict(re.findall(r"^  (\S+) +(.+)$", proc.stdout.split("verbs:\n", 1)[1], re.M))
    assert listed == {name: verb.summary for name, verb in VERBS.items()}


@pytest.mark.parametrize("verb", list(VERBS))
def test_each_verb_help_runs_under_its_name(verb: str, capsys: pytest.CaptureFixture) -> None:
    try:
        code = main([verb, "--help"])
    except SystemExit as stop:  # argparse's --help
        code = stop.code
    assert code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks {verb} ")


def test_unknown_verb_is_an_error_naming_the_verbs(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["serve_tables"])  # the module's name, not the verb
    assert stop.value.code == 2
    assert "serve-tables" in capsys.readouterr().err


def test_reports_record_the_verbs_command() -> None:
    assert (command_line("serve-tables", ["--out", "a b"])
            == "python -m benchmarks serve-tables --out 'a b'")


def test_the_docs_run_benchmarks_through_the_verbs() -> None:
    old, unknown = [], []
    for doc in DOCS:
        text = doc.read_text()
        rel = doc.relative_to(ROOT)
        old += [f"{rel}: {m}" for m in re.findall(
            r"python -m benchmarks\.\w+|python \S*benchmarks/\w+\.py|bash \S*smollm2_drafters\.sh",
            text)]
        unknown += [f"{rel}: {v}" for v in re.findall(r"python -m benchmarks ([a-z][a-z-]*)", text)
                    if v not in VERBS]
    assert not old, "use `python -m benchmarks VERB`: " + "; ".join(old)
    assert not unknown, "no such verb: " + "; ".join(unknown)


def _commands(text: str) -> list[str]:
    """A Markdown page's commands: the lines of its code blocks (fenced or indented,
    continuations joined) and its inline code that runs a verb with options."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            lines.append(line)
        else:
            lines += re.findall(r"`([^`]*python -m benchmarks [a-z-]+ --[^`]*)`", line)
    return re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()


def test_the_docs_benchmark_commands_parse() -> None:
    """Each benchmark command in the docs (README, docs/, benchmarks/README.md, the results
    page) parses with its verb's own parser (each module's build_parser; the drafters script
    has none): no option a verb no longer has, none missing."""
    parsers = {}
    for name, verb in VERBS.items():
        module = importlib.import_module(f"benchmarks.{verb.module}") if verb.module else None
        build = getattr(module, "build_parser", None) or getattr(module, "parser", None)
        if build is not None:
            parsers[name] = build
    assert set(parsers) == {name for name, verb in VERBS.items() if verb.module}
    checked, failed = 0, []
    for doc in DOCS:
        for line in _commands(doc.read_text()):
            match = re.search(r"python -m benchmarks ([a-z][a-z-]*)(.*)", line)
            if not match or match.group(1) not in parsers or "..." in match.group(2):
                continue
            argv = shlex.split(match.group(2).split(" # ")[0].split("  #")[0])
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    parsers[match.group(1)]().parse_args(argv)
            except SystemExit as stop:
                if stop.code:
                    failed.append(f"{doc.relative_to(ROOT)}: {match.group(1)}: "
                                  f"{err.getvalue().strip().splitlines()[-1]}")
            checked += 1
    assert not failed, "\n".join(failed)
    assert checked >= 40, checked  # the driver, serve-tables, sweep, profile-forward ... commands
