"""What a patch or hook relies on in an engine's source, and the check that it is there.

Each vLLM patch (:mod:`diffspec.plugin.vllm.patches`) and SGLang hook
(:mod:`diffspec.plugin.sglang.hooks`) names its :class:`Target`: the function it wraps or
replaces (module, qualified name, parameter names, property or not) and the lines of the
engine it relies on (a snippet of the source of some function: the call that reaches the
target, the attribute it reads). :func:`problems` checks a target against an engine's
source tree by parsing it (``ast``), without importing the engine, so one CPU machine
checks every engine version a patch lists (``tests/unit/test_engine_sources.py``, on the
sources :mod:`diffspec.testing.engine_sources` fetches). A patch is applied only on the
versions it lists.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Target", "module_file", "problems", "signature"]


@dataclass(frozen=True)
class Target:
    """A function of an engine that diffspec wraps, replaces or hooks."""

    module: str  # "vllm.v1.worker.gpu_model_runner"
    qualname: str  # "GPUModelRunner._model_forward"
    params: tuple[str, ...]  # parameter names in order; "*args", "**kwargs" spelled so
    is_property: bool = False
    # (module:qualname of a function or class, source snippet it must contain): the engine
    # lines the patch relies on (whitespace-insensitive; "a ... b": a, then later b)
    relies_on: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"


def module_file(root: Path, module: str) -> Path | None:
    """``module``'s source file under ``root`` (the folder holding the top package)."""
    base = Path(root, *module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _find(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: ast.AST | None = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        matches = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                     ast.AsyncFunctionDef))
                   and n.name == part]
        if not matches:
            return None
        # a property's getter is defined before its setter: the first definition
        node = matches[0]
    return node


def signature(node: ast.FunctionDef) -> tuple[str, ...]:
    """Parameter names in order (``*args`` / ``**kwargs`` with their stars)."""
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg is not None:
        names.append(f"*{a.vararg.arg}")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        names.append(f"**{a.kwarg.arg}")
    return tuple(names)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _parse(root: Path, module: str, cache: dict) -> tuple[ast.AST, str] | None:
    if module not in cache:
        path = module_file(root, module)
        if path is None:
            cache[module] = None
        else:
            source = path.read_text()
            cache[module] = (ast.parse(source), source)
    return cache[module]


def problems(root: str | Path, target: Target) -> list[str]:
    """What in the engine source under ``root`` no longer matches ``target`` (empty: it
    matches)."""
    root, cache, out = Path(root), {}, []
    parsed = _parse(root, target.module, cache)
    if parsed is None:
        return [f"{target.path}: module {target.module} not found under {root}"]
    node = _find(parsed[0], target.qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{target.path}: no such function"]
    got = signature(node)
    if got != target.params:
        out.append(f"{target.path}: parameters {got}, the patch expects {target.params}")
    decorated = any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
    if decorated != target.is_property:
        out.append(f"{target.path}: {'a' if decorated else 'not a'} property, the patch "
                   f"expects {'a' if target.is_property else 'no'} property")
    for where, snippet in target.relies_on:
        module, _, qualname = where.partition(":")
        parsed = _parse(root, module, cache)
        holder = None if parsed is None else _find(parsed[0], qualname)
        if holder is None:
            out.append(f"{target.path} relies on {where}, which is not there")
            continue
        text, at = _squash(ast.get_source_segment(parsed[1], holder) or ""), 0
        for part in snippet.split(" ... "):
            at = text.find(_squash(part), at)
            if at < 0:
                break
        if at < 0:
            out.append(f"{target.path} relies on {where} containing {snippet!r}, which it "
                       f"does not")
    return out
