# Sourced by the lent-GPU session scripts (gpu_*.sh), from the repository root on
# the device machine: installs the wheels of benchmarks/gpu_wheels.sh carried in
# .whl, puts them and this checkout on PYTHONPATH, records the device in
# $OUT/device.txt and the host CPU in $OUT/lscpu.txt, and defines `step NAME`
# (a timestamped heading in the log).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; lscpu | grep -E 'Model name|^CPU\(s\)'; } > "$OUT/device.txt" 2>&1
lscpu > "$OUT/lscpu.txt" 2>&1
cat "$OUT/device.txt"

step() { echo "=== $1 ($(date +%T))"; }
