"""diffspec's SGLang hooks, registered one way: AROUND hooks in SGLang's ``HookRegistry``
(applied by its ``load_plugins()``), each target at most once per process, however often
the plugin registers (SGLang loads plugins once per process it starts)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_around"]

_registered: set[str] = set()


def register_around(target: str, hook: Callable) -> None:
    """Register ``hook`` AROUND ``target`` (a dotted SGLang path); idempotent per target."""
    if target in _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType.AROUND)
    _registered.add(target)
