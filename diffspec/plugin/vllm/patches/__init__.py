"""Every change diffspec makes to vLLM where vLLM offers no hook, one file per patch.

The index with why / how / upstream / removal plan is ``diffspec/plugin/patches.md``;
:func:`apply_all` is called only from :func:`diffspec.plugin.vllm.register`, after the
version guard, and each patch is idempotent (vLLM loads plugins once per process, but a
process may call ``register`` again).
"""

from __future__ import annotations

import importlib

__all__ = ["PATCHES", "apply_all"]

# module name (in this package) -> vLLM releases it was checked against
PATCHES: dict[str, tuple[str, ...]] = {
    "speculative_method": ("0.32", "0.33"),
    "lookahead_slots": ("0.32", "0.33"),
    "runner_propose": ("0.32", "0.33"),
    "runner_forward": ("0.32",),
    "cpu_expand_kernel": ("0.32", "0.33"),
    "generation_stops": ("0.32",),
    "warm_up_profile": ("0.32",),
}


def apply_all(vllm_version: str) -> None:
    """Apply every patch in :data:`PATCHES` (the version guard already ran in register())."""
    for name in PATCHES:
        importlib.import_module(f"{__name__}.{name}").apply()


def mark(function, name: str):
    """Tag a replacement so a second ``apply`` sees it is already in place."""
    function.__diffspec_patch__ = name
    return function


def is_applied(function) -> bool:
    return getattr(function, "__diffspec_patch__", None) is not None
