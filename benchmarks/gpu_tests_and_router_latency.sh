#!/usr/bin/env bash
# One lent-GPU session (run on the device machine from the repository root, with
# the wheels of benchmarks/gpu_wheels.sh carried in .whl):
#   1. every GPU test and the Triton kernels against torch (a regression check of
#      the CUDA paths: graphs, fused kernels, KV tiers, spec decode, structured output);
#   2. what `heron router` adds to a streamed first token on loopback in front of a
#      GPU replica (random-weight Llama-3.2-1B shape, bf16), with cores to spare for
#      the router and the client, as a router runs beside GPU replicas (issue 18):
#      two runs of benchmarks/router_policies.py --latency-only, to be pooled.
# `--router-only` skips the tests; RUNS (default 2) and REQUESTS (default 1000) size the
# latency runs. Results go to $OUT (device.txt, lscpu.txt, pytest.txt, router-latency-*.json).
source "$(dirname "$0")/gpu_session_setup.sh"

step "GPU tests"
[ "${1:-}" = "--router-only" ] || timeout 180 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu tests/unit/test_triton_kernels.py \
    2>&1 | tail -40 | tee "$OUT/pytest.txt"

step "model"
# the router renders chat requests with the model's template: give the word-level tokenizer a plain one
python3 - <<'EOF' || exit 1
from benchmarks.gpu_bench import build_model
from transformers import AutoTokenizer
build_model("/tmp/llama-1b-random")
tokenizer = AutoTokenizer.from_pretrained("/tmp/llama-1b-random")
tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
tokenizer.save_pretrained("/tmp/llama-1b-random")
EOF

# BASE_SRC=DIR (another tree's src, carried): each run measures that tree's router first, then this one's
for run in $(seq "${RUNS:-2}"); do
    for tree in ${BASE_SRC:+base} this; do
        src=src; [ "$tree" = base ] && src=$BASE_SRC
        name=router-latency-$run${BASE_SRC:+-$tree}
        step "$name"
        PYTHONPATH=/tmp/site:$src:. timeout 170 python3 benchmarks/router_policies.py --latency-only \
            --latency-requests "${REQUESTS:-1000}" --out "/tmp/$name" \
            --replica-args "--model /tmp/llama-1b-random --dtype bfloat16 --max-model-len 2048" \
            --router-args "--model /tmp/llama-1b-random"
        cp "/tmp/$name/results.json" "$OUT/$name.json" 2>/dev/null
    done
done
step "done"
