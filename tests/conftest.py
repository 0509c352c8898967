"""Shared fixtures. The embedded model's tokenizer is loaded once per session."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter (tests/unit/
# test_triton_kernels.py). It must be chosen before any kernel is defined, i.e.
# before heron's Triton modules are imported; it changes nothing else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from heron.loader.model_source import default_model_path
    from heron.loader.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="session", autouse=True)
def _limit_threads():
    # CI has 2 cores; torch's default intra-op pool is fine, but keep inter-op at 1
    torch.set_num_interop_threads(1) if torch.get_num_interop_threads() != 1 else None
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get("HERON_TEST_DEVICE") == "cpu":
        return  # HERON_TEST_DEVICE=cpu: run the GPU tests that support it on the CPU
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
