#!/usr/bin/env bash
# GPU check (issue 12, item 6): on a machine with CUDA, run the tests marked `gpu`, then
# `pdserve bench engine --device cuda --dtype bfloat16`, and write the results to
# docs/benchmarks/engine-gpu.md. Budget: under 8 minutes on one GPU. CI never runs it.
#
# Unverified: written on a CPU-only machine; the first run on a GPU is its first test.
# The bench's MFU/MBU columns divide by the CPU roofline it measures, so on CUDA read only the
# times and tokens/s; --no-hf because transformers would run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=docs/benchmarks/engine-gpu.md

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
nvidia-smi -L || true

status=0
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/engine || status=$?

timeout 300 "$PY" -m pdserve.cli bench engine --device cuda --dtype bfloat16 --no-hf \
  --prompt-lens 128,512,2048 --batch-sizes 1,8,32 --decode-context 1024 --decode-steps 32 \
  --repeats 3 --output "$OUT.tmp" --json docs/benchmarks/engine-gpu.json || status=$?

if [ -f "$OUT.tmp" ]; then
  {
    echo "# Engine on CUDA (bfloat16)"
    echo
    echo "Written by \`scripts/gpu_check.sh\` on $(date -u +%Y-%m-%dT%H:%MZ):"
    echo "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'GPU: unknown')."
    echo "gpu tests exit status: ${status}. MFU/MBU below are against the CPU roofline: ignore them."
    echo
    cat "$OUT.tmp"
  } > "$OUT"
  rm -f "$OUT.tmp"
fi
exit "$status"
