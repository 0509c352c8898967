#!/usr/bin/env bash
# Wheels that heron needs on the lent GPU machine (Python 3.12, no network; its
# image has torch, triton, transformers, tokenizers, numpy, msgpack,
# prometheus-client, pytest... but not the server stack), at the versions this
# checkout's .venv resolved, into .whl/ (git-ignored through .git/info/exclude).
# Usage (repository root, after `make setup`): benchmarks/gpu_wheels.sh
# Then, on the device: carry [".whl"] and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:src:.
set -euo pipefail
names="annotated-doc annotated-types anyio apache-tvm-ffi fastapi gguf h11 httpcore2 httptools httpx2 idna jiter
jsonschema jsonschema-specifications openai opentelemetry-api pydantic pydantic-core pyzmq referencing rpds-py
sniffio starlette truststore typing-extensions typing-inspection uvicorn xgrammar"
mkdir -p .whl .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
freeze=$(.venv/bin/python -m pip freeze 2>/dev/null)
pins=()
for name in $names; do
    # pip freeze spells names with - or _ and any case
    pin=$(echo "$freeze" | grep -i -E "^${name//-/[-_]}==" || true)
    if [ -n "$pin" ]; then pins+=("$pin"); fi
done
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl | wc -l
