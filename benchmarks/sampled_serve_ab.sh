#!/usr/bin/env bash
# What sampling costs a served request on the CPU: `heron serve` with no flags (the embedded model) from
# another tree (BASE_SRC, e.g. a worktree of an older commit's src) and from this one, one after the other,
# twice, each measured by this tree's bench client at concurrency 1 and 8 (input 128, output 128, ignore_eos):
# greedy, temperature 0.7 alone (the chat page's default), and temperature 0.7 with top_p 0.9 (`heron chat`'s).
# Usage: BASE_SRC=/tmp/base/src benchmarks/sampled_serve_ab.sh OUT_DIR   (prints a line per run)
set -u
out=${1:?usage: BASE_SRC=DIR $0 OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
port=${PORT:-18611}
mkdir -p "$out"
for round in 1 2; do
    for tree in base new; do
        src=${BASE_SRC:?set BASE_SRC to the other tree\'s src}; [ $tree = new ] && src=$root/src
        PYTHONPATH=$src "$python" -m heron.entrypoints.cli serve --port "$port" > "$out/server-$tree.log" 2>&1 &
        pid=$!
        for _ in $(seq 120); do curl -sf -o /dev/null "http://127.0.0.1:$port/v1/models" && break; sleep 1; done
        for conc in 1 8; do
            for mode in greedy temp topp; do
                case $mode in
                    greedy) flags=(--temperature 0) ;;
                    temp) flags=(--temperature 0.7) ;;
                    topp) flags=(--temperature 0.7 --top-p 0.9) ;;
                esac
                result=$out/$tree-c$conc-$mode-r$round.json
                PYTHONPATH=$root/src "$python" -m heron.entrypoints.cli bench serve --port "$port" \
                    --num-prompts $((conc * 6)) --random-input-len 128 --random-output-len 128 --ignore-eos \
                    --max-concurrency $conc "${flags[@]}" --disable-tqdm --result-filename "$result" > /dev/null 2>&1
                "$python" -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2],
    'tpot_p50 %.2f ms' % d['median_tpot_ms'], 'out tok/s %.1f' % d['output_throughput'], 'failed', d['failed'])" \
                    "$result" "$tree c$conc $mode r$round"
            done
        done
        kill -TERM $pid
        wait $pid
    done
done
