"""Resolve SGLang server arguments the way a launch does, and report the outcome.

A script, run under SGLang's own interpreter with the CPU harness's environment
(:mod:`tests.engine.sglang_cpu`): ``python tests/engine/sglang_server_args.py JOB_JSON``.
JOB_JSON is ``{name: {"model": path, "server_args": {...}, "fields": [names]}}``; each case
builds ``ServerArgs(model_path=model, **CPU_ENGINE_KWARGS, **server_args)`` after SGLang's
``load_plugins()`` (diffspec's plugin included) and runs ``resolve_once()``, SGLang's whole
argument resolution (which calls diffspec's validation and ``handle_server_args`` hooks),
without starting an engine. Prints one line: ``RESULT {name: {"error": str | None,
"fields": {name: repr or value}, "log": [diffspec's log lines]}}`` plus ``"_plugin":
{"hooks": [diffspec's hooks in place], "log": [diffspec's log lines of load_plugins()]}``.

``DIFFSPEC_TEST_SGLANG_VERSION``: the SGLang version diffspec's plugin reads (an unsupported
release, to test the version refusal on the installed SGLang).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from sglang_generate import CPU_ENGINE_KWARGS  # a script: its own folder is on sys.path

# the engine runs' CPU settings, minus what a case sets itself
CPU_KWARGS = {k: v for k, v in CPU_ENGINE_KWARGS.items() if k not in ("log_level", "random_seed")}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _case(case: dict) -> dict:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    lines = _Lines()
    logger = logging.getLogger("diffspec")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out = {"error": None, "fields": {}, "log": lines.lines}
    try:
        args = ServerArgs(model_path=case["model"], **{**CPU_KWARGS, **case["server_args"]})
        args.resolve_once()
        view = resolving_view(args)
        for name in case.get("fields", []):
            value = getattr(view, name, None)
            out["fields"][name] = value if isinstance(value, (bool, int, str, type(None))) \
                else repr(value)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(lines)
    return out


def main() -> None:
    import importlib.metadata
    import os

    from sglang.srt.plugins import load_plugins

    fake = os.environ.get("DIFFSPEC_TEST_SGLANG_VERSION")
    if fake:
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: fake if name == "sglang" else real(name)
    lines = _Lines()
    logging.getLogger("diffspec").addHandler(lines)
    logging.getLogger("diffspec").setLevel(logging.INFO)
    load_plugins()
    logging.getLogger("diffspec").removeHandler(lines)
    from diffspec.plugin.sglang import hooks

    job = json.loads(Path(sys.argv[1]).read_text())
    result = {name: _case(case) for name, case in job.items()}
    result["_plugin"] = {"hooks": sorted(hooks._registered), "log": lines.lines}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
