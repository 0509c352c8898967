#!/usr/bin/env bash
# One lent-GPU session for issues 18 and 19 (run on the device machine from the
# repository root, with the wheels of benchmarks/gpu_wheels.sh carried in .whl):
#   1. the KV-connector GPU tests (pinned host tier, disk tier after a restart,
#      P/D pull, the pool taking the whole --gpu-memory-utilization budget) and
#      the block codec's CUDA round trip;
#   2. `heron serve --api-server-count M`, M = 1, 2, 4, at concurrency 128 on the
#      random-weight Llama-3.2-1B shape (bf16), four bench client processes;
#   3. TTFT of a 3,500-token prefix the pool cannot keep: recompute, pinned host
#      tier, disk tier, warm pool, and a restarted server's first request.
# Results go to $OUT (device.txt, lscpu.txt, pytest.txt, api-servers.json, kv-offload.json).
source "$(dirname "$0")/gpu_session_setup.sh"

step "GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kv_tiers_cuda.py tests/gpu/test_kv_block_codec_cuda.py \
    2>&1 | tail -40 | tee "$OUT/pytest.txt"

step "model"
python3 -c "from benchmarks.gpu_bench import build_model; build_model('/tmp/llama-1b-random')" || exit 1
MODEL=(--model /tmp/llama-1b-random --dtype bfloat16 --max-model-len 2048)

step "API servers"
timeout 330 python3 benchmarks/api_server_count.py --counts 1,2,4 --concurrency 128 --clients 4 --num-prompts 768 \
    --input-len 512 --output-len 256 --range-ratio 0.5 --tokenizer /tmp/llama-1b-random --out /tmp/api-servers \
    -- "${MODEL[@]}" --max-num-seqs 256 --kv-cache-memory-bytes 20GiB
cp /tmp/api-servers/results.json "$OUT/api-servers.json" 2>/dev/null

step "KV tiers TTFT"
# 3,500 words (one token each): 219 blocks, 112 MB of bf16 KV; the small pool holds 6,400 tokens
timeout 240 python3 benchmarks/kv_offload_ttft.py --rounds 3 --word-vocabulary 4000 --prefix-words 3500 \
    --max-model-len 4096 --pool 200MiB --out /tmp/kv-offload \
    --server-args "--model /tmp/llama-1b-random --dtype bfloat16 --enforce-eager --max-num-seqs 16"
cp /tmp/kv-offload/results.json "$OUT/kv-offload.json" 2>/dev/null
step "done"
