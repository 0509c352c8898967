#!/usr/bin/env bash
# Prefill/decode disaggregation against one server, on the same two cores (issue 19):
#   single:        one `heron serve` on cores 0-1
#   disaggregated: a prefill server on core 0, a decode server on core 1, and
#                  `heron router --prefill --decode` in front (cores 0-1)
# The same `heron bench serve` workload against each, one setup at a time
# (streamed requests with prompts of 256-768 tokens arriving at a steady rate):
# TTFT, TPOT and ITL, then one comparison table.
#   benchmarks/pd_disaggregation.sh OUTDIR [more heron bench serve flags]
set -euo pipefail
out=$1; shift
mkdir -p "$out"
producer='{"kv_connector": "HeronConnector", "kv_role": "kv_producer"}'
consumer='{"kv_connector": "HeronConnector", "kv_role": "kv_consumer"}'
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  for pid in "${pids[@]}"; do while kill -0 "$pid" 2> /dev/null; do sleep 0.2; done; done
  pids=()
}
trap stop_all EXIT
start() { local name=$1; shift; "$@" > "$out/$name.log" 2>&1 & pids+=($!); }
ready() { until curl -sf "$1/health" > /dev/null; do sleep 0.5; done; }
bench() {
  heron bench serve --base-url "$1" --label "$2" --dataset-name random --random-input-len 512 \
    --random-range-ratio 0.5 --random-output-len 64 --num-prompts 16 --request-rate 0.2 --seed 7 \
    --ignore-eos --disable-tqdm --save-result --result-dir "$out" --result-filename "$2.json" "${@:3}" \
    | tee "$out/$2.txt"
}

start single taskset -c 0,1 heron serve --port 8100 --max-model-len 2048
ready http://127.0.0.1:8100
bench http://127.0.0.1:8100 single "$@"
stop_all
sleep 3

# one core each: one thread each for torch and heron's kernels
start prefill env OMP_NUM_THREADS=1 taskset -c 0 heron serve --port 8101 --max-model-len 2048 \
  --kv-transfer-config "$producer"
start decode env OMP_NUM_THREADS=1 taskset -c 1 heron serve --port 8102 --max-model-len 2048 \
  --kv-transfer-config "$consumer"
ready http://127.0.0.1:8101
ready http://127.0.0.1:8102
start router taskset -c 0,1 heron router --port 8110 --prefill http://127.0.0.1:8101 \
  --decode http://127.0.0.1:8102 --policy round_robin
ready http://127.0.0.1:8110
bench http://127.0.0.1:8110 disaggregated "$@"
stop_all
heron bench compare "$out/single.json" "$out/disaggregated.json" | tee "$out/compare.txt"
