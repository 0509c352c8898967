#!/usr/bin/env bash
# The serve matrix of cpu_serve_matrix.sh with each server alone on the machine
# (started, measured at concurrency 1, 8 and 32, stopped), so that no idle peer
# competes for the two cores; then one comparison table per concurrency.
#   benchmarks/cpu_serve_alone.sh OUTDIR NAME='start command'@URL ...
# e.g. heron-int4='heron serve --port 8000 --quantization int4'@http://127.0.0.1:8000
set -euo pipefail
out=$1; shift
mkdir -p "$out"
here=$(dirname "$0")
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; command=${rest%@*}; url=${rest##*@}
  bash -c "exec $command" > "$out/server-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf "$url/v1/models" > /dev/null && break; sleep 1; done
  "$here/cpu_serve_matrix.sh" "$out/$name" "$name=$url" > "$out/$name.txt"
  kill "$server"; wait "$server" 2> /dev/null || true
  sleep 5
done
for conc in 1 8 32; do
  heron bench compare "$out"/*/"conc$conc.json" | tee "$out/compare-conc$conc.txt"
done
