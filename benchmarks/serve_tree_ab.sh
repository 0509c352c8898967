#!/usr/bin/env bash
# `heron serve` with no flags from this tree and from another tree's sources, each
# alone and alternated (ROUNDS times), at concurrency 1 on the issue-5 workload
# (cpu_serve_matrix.sh's random prompts of 100-400 tokens, 64-128 output tokens):
# TTFT and TPOT of one tree against the other on the same machine in one run.
#   benchmarks/serve_tree_ab.sh OUTDIR BASE_SRC [ROUNDS]
# e.g. git worktree add /tmp/base REV && benchmarks/serve_tree_ab.sh /tmp/ab /tmp/base/src 2
# Each run's files: OUTDIR/TREE-ROUND/ (startup.json, server.log, conc1.json, conc1.txt).
set -euo pipefail
out=$1; base_src=$2; rounds=${3:-2}; port=${PORT:-8140}
here=$(dirname "$0")
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for tree in this base; do
    if [ "$tree" = base ]; then pythonpath=$base_src; else pythonpath=${PYTHONPATH:-}; fi
    run="$out/$tree-$round"
    mkdir -p "$run"
    # ready means a completion succeeds (startup_time.py); only the server runs the other tree
    python "$here/startup_time.py" --url "http://127.0.0.1:$port" --keep -- \
      env PYTHONPATH="$pythonpath" bash -c "exec heron serve --port $port > '$run/server.log' 2>&1" > "$run/startup.json"
    server=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$run/startup.json")
    CONCURRENCIES=1 "$here/cpu_serve_matrix.sh" "$run" "$tree=http://127.0.0.1:$port" > /dev/null
    kill "$server"; while kill -0 "$server" 2> /dev/null; do sleep 0.2; done
    sleep 3
  done
done
grep -H -E "^(Median|P50) (TTFT|TPOT)" "$out"/*/conc1.txt
