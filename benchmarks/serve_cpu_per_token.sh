#!/usr/bin/env bash
# CPU time the API-server and engine-core processes spend per streamed token:
# a one-layer model (benchmarks/host_overhead.py builds it) served by `heron serve`,
# 512 requests x 128 streamed tokens at concurrency 64, CPU seconds read from /proc.
# Usage: PATH=.venv/bin:$PATH benchmarks/serve_cpu_per_token.sh [port]
set -euo pipefail
port=${1:-8411}
model=${TMPDIR:-/tmp}/heron-host-overhead-model
PYTHONPATH=src:. python3 -c "from benchmarks.host_overhead import build_tiny_model; build_tiny_model('$model')"
heron serve --model "$model" --port "$port" --dtype float32 --max-num-seqs 128 > /tmp/heron-serve-cpu.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do sleep 1; curl -sf "localhost:$port/health" > /dev/null && break; done
core=$(pgrep -f "heron.engine.core_proc" -P "$server" | head -1)
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # clock ticks (1/100 s)
a0=$(cpu "$server"); c0=$(cpu "$core")
heron bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$model" --dataset-name random \
    --num-prompts 512 --random-input-len 64 --random-output-len 128 --max-concurrency 64 --ignore-eos \
    | grep -E "Output token throughput|Mean TPOT"
a1=$(cpu "$server"); c1=$(cpu "$core")
tokens=$((512 * 128))
echo "API server: $(( (a1 - a0) * 10000000 / tokens )) ns CPU per streamed token"
echo "engine core: $(( (c1 - c0) * 10000000 / tokens )) ns CPU per streamed token (includes the model on the CPU)"
