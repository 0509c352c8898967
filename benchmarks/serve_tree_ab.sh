#!/usr/bin/env bash
# `heron serve` with no flags from this tree and from another tree's sources, each
# alone and alternated (ROUNDS times), at concurrency 1 on the issue-5 workload
# (cpu_serve_matrix.sh's random prompts of 100-400 tokens, 64-128 output tokens):
# TTFT and TPOT of one tree against the other on the same machine in one run.
#   benchmarks/serve_tree_ab.sh OUTDIR BASE_SRC [ROUNDS]
# e.g. git worktree add /tmp/base REV && benchmarks/serve_tree_ab.sh /tmp/ab /tmp/base/src 2
set -euo pipefail
out=$1; base_src=$2; rounds=${3:-2}; port=${PORT:-8140}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for tree in this base; do
    if [ "$tree" = base ]; then pythonpath=$base_src; else pythonpath=${PYTHONPATH:-}; fi
    PYTHONPATH=$pythonpath heron serve --port "$port" > "$out/server-$tree-$round.log" 2>&1 &
    server=$!
    # ready means a completion succeeds
    until curl -sf "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
      -d '{"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 1}' > /dev/null; do
      kill -0 "$server" 2> /dev/null || { echo "server ($tree) exited: $out/server-$tree-$round.log"; exit 1; }
      sleep 1
    done
    heron bench serve --base-url "http://127.0.0.1:$port" --label "$tree" --dataset-name random --num-prompts 16 \
      --random-input-len 250 --random-range-ratio 0.6 --random-output-len 96 --random-output-range-ratio 0.33 \
      --max-concurrency 1 --ignore-eos --temperature 0 --seed 1 --disable-tqdm \
      --result-dir "$out" --result-filename "conc1-$tree-$round.json" > "$out/conc1-$tree-$round.txt"
    kill "$server"; while kill -0 "$server" 2> /dev/null; do sleep 0.2; done
    sleep 3
  done
done
grep -H -E "^(Median|P50) (TTFT|TPOT)" "$out"/conc1-*.txt
