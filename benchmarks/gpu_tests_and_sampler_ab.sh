#!/usr/bin/env bash
# One lent-GPU session (device machine, repository root, wheels of
# benchmarks/gpu_wheels.sh carried in .whl): every GPU test and the Triton
# kernels against torch, then the sampler's filters (benchmarks/sampler_ops_time.py
# --check) and a sampled decode step (benchmarks/gpu_profile_decode.py --sampled),
# each for BASE_SRC (another tree's src, carried; optional) and this tree, in that
# order, on the same device (SAMPLER_OPS=0: the decode step alone). Results go to
# $OUT (device.txt, lscpu.txt, pytest.txt (the whole log), sampler-ops-{base,this}.
# {json,txt}, profile-{base,this}.txt).
source "$(dirname "$0")/gpu_session_setup.sh"

step "GPU tests"
timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu tests/unit/test_triton_kernels.py \
    2>&1 | tee "$OUT/pytest.txt" | tail -40

step "model"
python3 -c 'from benchmarks.gpu_bench import build_model; build_model("/tmp/llama-1b-random")' > /dev/null 2>&1 || exit 1

for tree in ${BASE_SRC:+base} this; do
    src=src; [ "$tree" = base ] && src=$BASE_SRC
    if [ "${SAMPLER_OPS:-1}" != 0 ]; then
        step "sampler ops ($tree)"
        PYTHONPATH=/tmp/site:$src:. timeout 120 python3 benchmarks/sampler_ops_time.py --check --batch 1 64 256 \
            --out "$OUT/sampler-ops-$tree.json" 2>&1 | grep -v Warning | tee "$OUT/sampler-ops-$tree.txt"
    fi
    step "sampled decode step ($tree)"
    PYTHONPATH=/tmp/site:$src:. timeout 150 python3 benchmarks/gpu_profile_decode.py --batch 1 64 --kernels --sampled \
        2>&1 | grep -v Warning | tee "$OUT/profile-$tree.txt" | grep -E "^batch"
done
step "done"
