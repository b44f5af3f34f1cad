#!/usr/bin/env bash
# Prefill tokens/s of pdserve (bf16x3 and bf16 prefill formats) and vLLM's CPU build on the same
# weights, alternated in one run (A B A B: the host's matrix-unit speed drifts between minutes, so
# each round's ratio is what compares). Usage:
#   docs/benchmarks/models/prefill_vs_vllm.sh M.gguf HF_FOLDER OUT_DIR [ROUNDS]
set -euo pipefail
gguf=$1 hf=$2 out=$3 rounds=${4:-2}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
mkdir -p "$out"
{ lscpu | grep -E "Model name|^CPU\(s\)"; grep -m1 -E "^model\s" /proc/cpuinfo; } > "$out/machine.txt"
for r in $(seq 1 "$rounds"); do
  echo "round $r load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
  "$root/.venv/bin/pdserve" bench engine --model "$gguf" --threads 2 --prompt-lens 512,2048 \
    --batch-sizes 1 --contexts 128 --quantization gguf-a16 --kv-cache-dtypes float16 \
    --prefill-formats bf16x3,bf16 --repeats 3 --decode-steps 4 --no-hf --no-llama-cpp \
    --no-attention --json "$out/pdserve-$r.json" --output "$out/pdserve-$r.md"
  "$root/.venv-vllm/bin/python" "$here/vllm_prefill.py" "$hf" "$out/vllm-$r.json" > "$out/vllm-$r.log" 2>&1
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
