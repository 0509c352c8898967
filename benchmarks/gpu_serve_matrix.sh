#!/usr/bin/env bash
# Serve percentiles on a GPU: heron serve on the Llama-3.2-1B-shaped model of
# gpu_bench.py (bf16), one streaming client (greedy, ignore_eos, random prompts of
# 256-768 tokens, 96-160 output tokens) at concurrency 1, 8, 32 and 128, with
# async scheduling on (the default) and off.
#   PYTHONPATH=src:. benchmarks/gpu_serve_matrix.sh OUTDIR
set -euo pipefail
out=$1
mkdir -p "$out"
model=/tmp/llama-1b-random
python3 -c "from benchmarks.gpu_bench import build_model; build_model('$model')"
heron() { python3 -m heron.entrypoints.cli "$@"; }
for mode in async no-async; do
  heron serve --model "$model" --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --port 8000 \
    --"$mode"-scheduling > "$out/server-$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 240); do
    python3 -c "import httpx; httpx.get('http://127.0.0.1:8000/v1/models').raise_for_status()" 2>/dev/null && break
    sleep 0.5
  done
  for conc in 1 8 32 128; do
    case $conc in 1) n=16;; 8) n=64;; 32) n=128;; 128) n=512;; esac
    heron bench serve --base-url http://127.0.0.1:8000 --label "heron-$mode" --tokenizer "$model" \
      --dataset-name random --num-prompts $n --random-input-len 512 --random-range-ratio 0.5 \
      --random-output-len 128 --random-output-range-ratio 0.25 --max-concurrency $conc --ignore-eos \
      --temperature 0 --seed 1 --disable-tqdm --save-result --result-dir "$out" \
      --result-filename "$mode-conc$conc.json" > "$out/$mode-conc$conc.txt"
    grep -E "throughput|TTFT|TPOT|ITL" "$out/$mode-conc$conc.txt" | grep -iE "output token throughput|median|p99" | \
      sed "s/^/$mode conc$conc: /"
  done
  kill $server; wait $server || true
done
