"""Ready means ready: while the engine core loads, every /v1 route (the model
list included) answers 503 with Retry-After, so a client or load balancer that
probes any of them sends no traffic too early; once it serves, the start-up log
and /metrics say which compute path each step runs, and with no flags that is
the fast path (int4, native decode steps)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from heron.kernels.cpu.isa import supported_isas
from heron.kernels.cpu.library import native_library
from tests.e2e.server_process import ServerProcess

MODEL = "SmolLM2-135M-Instruct"


def first_http_answer(base_url: str, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{base_url}/health", timeout=2.0)
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_v1_routes_answer_503_until_the_engine_serves():
    server = ServerProcess(wait_ready=False)
    try:
        engine_core = server.engine_core_pid(timeout=60)
        os.kill(engine_core, signal.SIGSTOP)  # held mid-load: the server must say "loading", whatever it is asked
        try:
            assert first_http_answer(server.base_url).json()["status"] == "loading"
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
            ):
                response = httpx.request(method, f"{server.base_url}{path}", json=body, timeout=10)
                assert response.status_code == 503, path
                assert response.json()["error"]["code"] == "model_loading"
                assert response.headers["retry-after"] == "1"
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.InternalServerError):
                client.models.list()
        finally:
            os.kill(engine_core, signal.SIGCONT)
        server.wait_ready()
        assert [model.id for model in client.models.list()] == [MODEL]
        stream = client.chat.completions.create(  # the default path end to end, streamed
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of Japan?"}], temperature=0,
            max_tokens=16, stream=True,
        )
        assert "Tokyo" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        log = server.read_log()
        assert "compute path: device=cpu" in log
        assert server.metric("heron:compute_path_info", device="cpu") == 1.0
        if native_library() is not None and "avx2" in supported_isas():  # the default fast path: int4, native decode
            assert server.metric("heron:compute_path_info", quantization="int4", dtype="float32",
                                 decode="native (one C call per step)", linear="heron int4 C kernels") == 1.0
    finally:
        server.stop()
