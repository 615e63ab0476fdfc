#!/usr/bin/env bash
# The GPU check (issue 29): the `gpu` test tier, then scripts/gpu_check.py's checks, on one
# GPU with PyTorch + transformers only (no vLLM, SGLang or network), sized for an H100 / H200
# within 8 minutes (not yet timed on one: no GPU was lent). Figures: OUT/gpu-check.json
# (the results page shows them), the tier's results: OUT/gpu-tier.xml. Exit status: non-zero if any test or check failed.
#   bash scripts/gpu_check.sh                      # --device cuda --out benchmarks/results/gpu-check
#   bash scripts/gpu_check.sh --device cpu --quick # the CPU test of this command
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
out=benchmarks/results/gpu-check
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
mkdir -p "$out"
python=${PYTHON:-python}
status=0
"$python" -m pytest tests/gpu -q -s -p no:cacheprovider --junitxml "$out/gpu-tier.xml" \
  || status=$?
if [ "$device" = cuda ] && grep -q 'skipped="[1-9]' "$out/gpu-tier.xml"; then
  echo "gpu_check: the gpu tier skipped tests on --device cuda (is CUDA visible?)" >&2
  status=1
fi
"$python" scripts/gpu_check.py --device "$device" --out "$out/gpu-check.json" "${extra[@]}" \
  || status=$?
echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo FAILED) (figures: $out/gpu-check.json)"
exit $status
