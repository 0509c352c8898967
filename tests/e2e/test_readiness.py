"""Ready means ready: while the engine core loads, every /v1 route (the model
list included) answers 503 with Retry-After, so a client or load balancer that
probes any of them sends no traffic too early; once it serves, the start-up log
and /metrics say which compute path each step runs, and with no flags that is
the fast path (int4, native decode steps)."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest

from heron.kernels.cpu.isa import supported_isas
from heron.kernels.cpu.library import native_library
from tests.e2e.server_process import ServerProcess, descendants, wait_for

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


# heron's command line, with the API server's tokenizer load held until a file exists (argv[1])
HELD_TOKENIZER = """
import os, sys, time
import heron.engine.async_llm as async_llm
from heron.entrypoints.cli import main
load = async_llm.load_tokenizer
def held(model_config):
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    return load(model_config)
async_llm.load_tokenizer = held
sys.exit(main(sys.argv[2:]))
"""


def test_the_server_answers_while_its_tokenizer_loads(tmp_path):
    """The API server loaded the tokenizer (seconds: transformers' imports, a large
    vocabulary) before it answered anything, so a probe with a short timeout saw
    no answer at all and a router's breaker opened. It answers "loading" now,
    and /tokenize says the tokenizer is not there yet."""
    release = tmp_path / "release"
    server = ServerProcess(wait_ready=False, launcher=("-c", HELD_TOKENIZER, str(release)))
    try:
        assert first_http_answer(server.base_url).json() == {"status": "loading"}
        wait_for(lambda: "engine core ready" in server.read_log(), timeout=120, what="the engine core to load")
        health = httpx.get(f"{server.base_url}/health", timeout=2.0)
        assert (health.status_code, health.json()) == (503, {"status": "loading"})  # the tokenizer is not there
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
                                   ("POST", "/detokenize", {"tokens": [1]})):
            response = httpx.request(method, f"{server.base_url}{path}", json=body, timeout=2.0)
            assert (response.status_code, response.json()["error"]["code"]) == (503, "model_loading"), path
        release.touch()
        server.wait_ready(60)
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi"}, timeout=10).json()["tokens"]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, temperature=0)
        assert answer.usage.prompt_tokens == len(tokens)
        assert "API server: froze" in server.read_log()  # its start-up objects, the tokenizer's among them
    finally:
        server.stop()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_tokenizer_that_will_not_load_is_a_usage_error(tmp_path, api_servers):
    """Loaded while the server answers, its failure still ends ``heron serve``
    as a bad flag does: exit 2, "heron: error: ..." once per API server, no
    traceback (several API servers each printed one), no engine core left."""
    (tmp_path / "tokenizer.json").write_text("{")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    server = ServerProcess("--tokenizer", str(tmp_path), "--api-server-count", str(api_servers), wait_ready=False)
    try:
        started: set[int] = set()  # the engine core and API servers it started
        deadline = time.monotonic() + 180
        while server.process.poll() is None and time.monotonic() < deadline:
            started |= set(descendants(server.process.pid))
            time.sleep(0.1)
        assert server.process.wait(1) == 2
        log = server.read_log()
        assert log.count("heron: error: cannot load a tokenizer from") == api_servers, log
        assert "Traceback" not in log, log
        assert len(started) >= api_servers
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in started), what="its processes to end")
    finally:
        server.stop()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_a_gguf_whose_tensors_do_not_match_its_metadata_is_a_usage_error(tmp_path, api_servers):
    """Refused from its header, as `heron: error` and exit 2: with several API
    servers each raised it as a traceback (the launcher leaves resolving the
    model to them), and the launcher exited 1, which a supervisor restarts."""
    import numpy as np
    from gguf import GGUFWriter

    path = str(tmp_path / "layerless.gguf")
    writer = GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    server = ServerProcess("--model", path, "--api-server-count", str(api_servers), wait_ready=False)
    try:
        assert server.process.wait(180) == 2
        log = server.read_log()
        assert log.count("heron: error: ") == api_servers and "lacks 10 of the model's tensors" in log, log
        assert "Traceback" not in log, log
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [(), ("--api-server-count", "2"), ("--data-parallel-size", "2")],
                         ids=["one", "two-api-servers", "two-engine-cores"])
def test_a_checkpoint_the_engine_core_cannot_load_is_a_usage_error(tmp_path, embedded_tokenizer, flags):
    """A safetensors checkpoint lacking a tensor fails where the weights are read, in
    the engine core. It ended ``heron serve`` with the engine core's traceback, a
    second copy in the API server's log, and exit 1 (a supervisor restarts it, to
    fail again); ``heron generate`` said it as a usage error. Now ``heron serve``
    does too, with any number of API servers or engine cores."""
    from safetensors.torch import load_file, save_file

    from tests.model.conftest import build_tiny_model

    directory = build_tiny_model(str(tmp_path / "model"), {"model_type": "llama"}, embedded_tokenizer)
    weights = load_file(os.path.join(directory, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    server = ServerProcess("--model", directory, "--max-model-len", "256", *flags, wait_ready=False)
    try:
        assert server.process.wait(180) == 2
        log = server.read_log()
        said = re.findall(r"^heron: error: (?:engine core [01]: )?(.*)$", log, re.MULTILINE)
        assert said == [f"{directory}: the checkpoint lacks 1 of the model's weights (model.layers.1.mlp.up_proj."
                        "weight): an incomplete download or export?"] * (2 if "--api-server-count" in flags else 1), log
        assert "Traceback" not in log, log
    finally:
        server.stop()


def test_serving_requests_imports_nothing_heavy_into_the_api_server():
    """The API server never imports torch (the engine core holds the model). Every
    request's output-constraint check imported the structured-output backend, and
    with it torch and xgrammar, though no request was constrained: a server's first
    completion took about a second instead of milliseconds, and start-up as
    measured to the first completion (issue #16) paid it."""
    server = ServerProcess()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logprobs=2)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, stream=True)
        assert [chunk for chunk in chat]
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        with open(f"/proc/{server.process.pid}/maps") as maps:
            assert "libtorch" not in maps.read()
    finally:
        server.stop()


# put on the path of every process of the server (sitecustomize): the engine core's start fails as
# $HERON_TEST_ENGINE_START says: "disk-full" (an OSError that is not the user's to fix), "damaged-unsaid" (a
# ValueError, as a damaged checkpoint raises, its last message never sent)
FAILING_ENGINE_START = """
import os, sys
mode = os.environ.get("HERON_TEST_ENGINE_START")
if mode and "heron.engine.core_proc" in sys.orig_argv:
    from heron.engine import core, core_channels
    def fail(self, *args, **kwargs):
        if mode == "disk-full":
            raise OSError(28, "No space left on device")
        raise ValueError("the checkpoint is damaged (a test)")
    core.EngineCore.__init__ = fail
    if mode == "damaged-unsaid":
        core_channels.ClientChannels.send_failure = lambda self, *args, **kwargs: None
"""


@pytest.mark.parametrize(("mode", "flags", "code", "said"), [
    ("disk-full", (), 1, None),
    ("damaged-unsaid", (), 2, "heron: error: the engine core could not load the model (its log says why)"),
    ("damaged-unsaid", ("--api-server-count", "2"), 2,
     "heron: error: engine core 0 could not load the model (its log above says why)"),
])
def test_an_engine_core_start_failure_is_a_usage_error_only_when_it_is_one(tmp_path, mode, flags, code, said):
    """A start that fails for a reason not the user's to fix (a full disk here; a bug)
    keeps its traceback and exit 1: an OSError was said as a usage error, exit 2. A
    load error whose message is lost (sent before any API server connected, or an API
    server told of the exit first) is still one, by the engine core's exit code."""
    (tmp_path / "sitecustomize.py").write_text(FAILING_ENGINE_START)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    server = ServerProcess(*flags, wait_ready=False, env={"PYTHONPATH": path, "HERON_TEST_ENGINE_START": mode})
    try:
        assert server.process.wait(180) == code
        log = server.read_log()
        if said is None:
            assert "heron: error" not in log and "Traceback" in log and "No space left on device" in log, log
        else:
            assert said in log and "Traceback" not in log, log
            assert "the checkpoint is damaged (a test)" in log, log  # the engine core's own line
    finally:
        server.stop()
