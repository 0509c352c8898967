#!/usr/bin/env bash
# The serve matrix of cpu_serve_matrix.sh with each server alone on the machine
# (started, measured at concurrency 1, 8 and 32, stopped), so that no idle peer
# competes for the two cores; then one comparison table per concurrency.
#   benchmarks/cpu_serve_alone.sh OUTDIR NAME='start command'@URL ...
# e.g. heron='heron serve --port 8000'@http://127.0.0.1:8000
set -euo pipefail
out=$1; shift
mkdir -p "$out"
here=$(dirname "$0")
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; command=${rest%@*}; url=${rest##*@}
  # ready means a completion succeeds (a listed model may still be loading); the
  # start-up time to that completion is recorded beside the matrix
  python "$here/startup_time.py" --url "$url" --keep -- bash -c "exec $command > '$out/server-$name.log' 2>&1" \
    | tee "$out/startup-$name.json"
  server=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$out/startup-$name.json")
  "$here/cpu_serve_matrix.sh" "$out/$name" "$name=$url" > "$out/$name.txt"
  kill "$server"; while kill -0 "$server" 2> /dev/null; do sleep 0.2; done
  sleep 5
done
for conc in 1 8 32; do
  heron bench compare "$out"/*/"conc$conc.json" | tee "$out/compare-conc$conc.txt"
done
