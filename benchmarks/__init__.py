"""diffspec benchmarks, behind one entry point: ``python -m benchmarks VERB`` (``__main__.py``
lists the verbs). One driver (``driver.py``), one adapter per engine (``adapters/``), shared
metrics (``metrics.py``), a forward-latency profiler (``profile_forward.py``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

ENTRY = "python -m benchmarks"


def prog(verb: str) -> str:
    """A verb's ``prog`` for its argument parser: how ``--help`` and errors spell the command."""
    return f"{ENTRY} {verb}"


def verb_parser(verb: str, description: str | None, *,
                formatter_class: Any = argparse.RawDescriptionHelpFormatter,
                **kwargs: Any) -> argparse.ArgumentParser:
    """A verb's argument parser: named as the entry point spells it, its description (the
    module's docstring, as written unless ``formatter_class`` says otherwise)."""
    return argparse.ArgumentParser(prog=prog(verb), description=description,
                                   formatter_class=formatter_class, **kwargs)


def name_value(form: str) -> Callable[[str], tuple[str, str]]:
    """An argparse ``type`` for ``NAME=VALUE`` options: the pair, or an error that shows
    ``form`` (how the option is written)."""
    def parse(item: str) -> tuple[str, str]:
        name, _, value = item.partition("=")
        if not name or not value:
            raise argparse.ArgumentTypeError(f"write it as {form}, got {item!r}")
        return name, value
    return parse


def command_line(verb: str, argv: Sequence[str] | None) -> str:
    """The command that reruns a benchmark, as its report records it (the verb's form);
    ``argv`` None: this process's arguments."""
    return f"{prog(verb)} {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()
