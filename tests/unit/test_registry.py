"""The method registry (``diffspec/methods.py``) is the single source: its entries are
consistent, its lazy paths point at real code, every method runs on a bundled model, the
README's tables are generated from it, and no other list of method names or architectures
remains in the package or the benchmarks."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffspec.assets import ASSETS_DIR
from diffspec.core.checkpoint import inspect_checkpoint, require_method
from diffspec.methods import (
    FAMILIES,
    METHODS,
    diffspec_methods,
    layout_table,
    load_object,
    methods_for_engine,
    status_table,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _module_file(target: str) -> Path:
    module = target.partition(":")[0]
    path = ROOT / (module.replace(".", "/") + ".py")
    return path if path.is_file() else ROOT / module.replace(".", "/") / "__init__.py"


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name
               for node in tree.body)


def _engine_targets() -> list[str]:
    targets = [t for f in FAMILIES.values() for t in (*f.vllm_models.values(),
                                                      *f.sglang_models.values())]
    targets += [e.worker for m in METHODS.values() for e in (m.vllm, m.sglang)
                if e is not None and e.worker is not None]
    return targets


def test_importing_the_registry_imports_no_torch_or_engine() -> None:
    code = ("import sys, diffspec.methods; "
            "assert not {'torch', 'vllm', 'sglang'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_methods_name_existing_families_and_engine_entries_are_unique() -> None:
    for method in METHODS.values():
        assert set(method.families) <= set(FAMILIES), method.name
        if method.origin == "diffspec":
            assert method.reference is not None and method.bundled is not None, method.name
    for engine in ("vllm", "sglang"):
        names = [m.engine(engine).name for m in METHODS.values() if m.engine(engine)]
        assert len(names) == len(set(names)), engine
    for family in FAMILIES.values():
        assert set(family.vllm_models) <= set(family.architectures), family.name
        assert set(family.sglang_models) <= set(family.architectures), family.name
        assert set(family.hf_configs) <= set(family.model_types), family.name


@pytest.mark.parametrize("target", sorted(set(_engine_targets())))
def test_engine_classes_exist_where_the_registry_says(target: str) -> None:
    """Engine classes cannot be imported without the engine: check the file defines them."""
    path = _module_file(target)
    assert path.is_file(), target
    assert _defines(path, target.partition(":")[2]), target


@pytest.mark.parametrize("method", [m for m in METHODS.values() if m.reference],
                         ids=lambda m: m.name)
def test_reference_factory_is_importable_and_bundled_model_serves_it(method) -> None:
    assert callable(load_object(method.reference))
    bundled = ASSETS_DIR / method.bundled
    assert (bundled / "config.json").is_file(), f"{method.name}: no bundled model at {bundled}"
    info = inspect_checkpoint(bundled)
    if method.families:
        require_method(info, method.name)


@pytest.mark.parametrize("target", sorted({t for f in FAMILIES.values()
                                           for t in (*f.hf_configs.values(),
                                                     *([f.ar_view] if f.ar_view else []))}))
def test_engine_free_targets_import(target: str) -> None:
    assert load_object(target) is not None


def test_methods_for_engine_are_the_plugins_methods() -> None:
    from diffspec.plugin.sglang.config import self_spec_algorithms
    from diffspec.plugin.vllm.config import self_spec_methods

    assert set(self_spec_methods()) == {m.vllm.name for m in diffspec_methods()
                                        if m.vllm and m.vllm.flag == "--speculative-config"}
    # fast_dllm and refusion run on vLLM's diffusion path (selected by the checkpoint), not
    # as speculative methods
    assert not {"fast_dllm", "refusion"} & set(self_spec_methods())
    assert set(methods_for_engine("vllm", flag="--diffusion-config")) == {"fast_dllm",
                                                                          "refusion"}
    assert set(self_spec_algorithms()) == {m.sglang.name for m in diffspec_methods()
                                           if m.sglang and m.sglang.flag == "--speculative-algorithm"}
    assert set(methods_for_engine("vllm", "engine")) == {"ngram", "eagle3", "dflash"}


@pytest.mark.parametrize(("name", "table"), [("status", status_table), ("layout", layout_table)])
def test_readme_tables_are_the_registrys(name: str, table) -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- registry:{name} -->\n(.*?)\n<!-- /registry:{name} -->", readme,
                      re.S)
    assert block is not None, f"README has no registry:{name} block"
    assert block.group(1) == table(), (
        f"README's {name} table is stale: regenerate it from `python -m diffspec.methods`")


def test_layout_paths_exist() -> None:
    for path in re.findall(r"`(diffspec/[\w/]+\.py)`", layout_table()):
        assert (ROOT / path).is_file(), path


def _string_collections(path: Path):
    """Every list / tuple / set literal and dict's keys of string constants in a file
    (``__all__`` export lists aside)."""
    tree = ast.parse(path.read_text())
    exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
    for node in ast.walk(tree):
        if id(node) in exports:
            continue
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        values = {i.value for i in items if isinstance(i, ast.Constant)
                  and isinstance(i.value, str)}
        if values:
            yield node.lineno, values


def test_no_second_list_of_methods_or_architectures() -> None:
    """Outside the registry, no literal collection names two or more methods (one of them a
    method that is not also a family name: family tables such as "which families have a
    causal Qwen base" are checkpoint logic) or two or more of diffspec's own architectures
    (stock ones such as Qwen3ForCausalLM may appear in model-building code)."""
    methods = {m.name for m in METHODS.values()}
    methods |= {e.name for m in METHODS.values() for e in (m.vllm, m.sglang) if e}
    method_only = methods - set(FAMILIES)
    own_archs = {a for f in FAMILIES.values() for a in (*f.vllm_models, *f.sglang_models)}
    offenders = []
    for path in [*(ROOT / "diffspec").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        if path.name == "methods.py" and path.parent.name == "diffspec":
            continue
        for line, values in _string_collections(path):
            named = values & methods
            if (len(named) >= 2 and named & method_only) or len(values & own_archs) >= 2:
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {sorted(values)}")
    assert not offenders, "lists that belong in diffspec/methods.py:\n" + "\n".join(offenders)


def test_reference_decoder_package_imports_no_torch() -> None:
    code = ("import sys, diffspec.spec_workers.reference, diffspec.plugin.vllm, "
            "diffspec.plugin.sglang; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert importlib.import_module("diffspec.spec_workers.reference").load_decoder
