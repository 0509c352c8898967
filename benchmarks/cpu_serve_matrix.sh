#!/usr/bin/env bash
# Serve benchmark matrix used in BENCHMARKS.md: one neutral streaming client, greedy,
# ignore_eos, random English-word prompts of 100-400 tokens, 64-128 output tokens,
# at concurrency 1, 8 and 32, against every server given as NAME=URL.
#   benchmarks/cpu_serve_matrix.sh OUTDIR heron=http://127.0.0.1:8000 vllm=http://127.0.0.1:8100
# CONCURRENCIES="1" runs only some of them.
# Each concurrency draws its own prompts (seed = the concurrency: 1, 8, 32), so a server's
# prefix cache never holds a run's prompts from the run before. Until 2026-11-26 every
# concurrency used seed 1, so the first 16 prompts at 8 and the first 48 at 32 repeated the
# runs before them (heron logged prefix-cache hit rates up to 87%): SAME_SEED=1 reproduces
# the figures recorded that way.
set -euo pipefail
out=$1; shift
mkdir -p "$out"
urls=(); labels=()
for pair in "$@"; do labels+=(--label "${pair%%=*}"); urls+=(--base-url "${pair#*=}"); done
for conc in ${CONCURRENCIES:-1 8 32}; do
  case $conc in 1) n=16;; 8) n=48;; 32) n=96;; esac
  seed=$conc; [ -n "${SAME_SEED:-}" ] && seed=1
  heron bench serve "${urls[@]}" "${labels[@]}" --dataset-name random --num-prompts $n \
    --random-input-len 250 --random-range-ratio 0.6 --random-output-len 96 --random-output-range-ratio 0.33 \
    --max-concurrency $conc --ignore-eos --temperature 0 --seed $seed --disable-tqdm \
    --result-dir "$out" --result-filename "conc$conc.json" | tee "$out/conc$conc.txt"
done
