"""The embedded model (SmolLM2-135M-Instruct, GGUF) in heron and, as the
reference, in transformers (which dequantizes the same GGUF to float32)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.e2e.server_process import ServerProcess


@pytest.fixture(scope="session")
def reference_model():
    from transformers import AutoModelForCausalLM

    from heron.loader.model_source import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@torch.inference_mode()
def reference_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int = 2) -> list[int]:
    """transformers' greedy generate; stops after EOS like heron does."""
    output = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    return output[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def server():
    """A live `heron serve` on the embedded model, shared by the e2e modules: float32
    unquantized, whose greedy answers the tests know ("Paris"), and whose decoding
    outlasts a client that holds a stream (the default int4 path is tested in
    test_readiness.py)."""
    process = ServerProcess("--max-model-len", "512", "--quantization", "none", "--dtype", "float32")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def default_server():
    """A live `heron serve` as a user starts it (the default int4 fast path),
    with room for long conversations (tools, the Responses API, the chat page)."""
    process = ServerProcess("--max-model-len", "2048")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def default_client(default_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `make setup` installs Debian's as root")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, headless, driven by Playwright (mark the module ``needs_chromium``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()
