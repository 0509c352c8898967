"""What a live server writes to its logs, at its most verbose (``--log-level
DEBUG``, uvicorn's access log included): never an API key, right or wrong; no
prompt or output unless ``--log-requests`` is given; with it, each request's
id, prompt, sampling parameters and output text."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, wait_for

MODEL = "SmolLM2-135M-Instruct"


class Traffic:
    """Requests with secrets the log must (or, with --log-requests, must only
    partly) keep: the key, a wrong key, unique words in the prompts, and the
    sampled outputs."""

    def __init__(self, server: ServerProcess, key: str) -> None:
        self.server = server
        self.key = key
        self.wrong_key = f"wrong-{secrets.token_hex(16)}"
        self.prompt_word = f"quokka{secrets.token_hex(6)}"
        self.chat_word = f"wombat{secrets.token_hex(6)}"
        self.outputs: list[str] = []
        self.statuses: dict[str, int] = {}

    def post(self, path: str, body: dict, key: str | None, **headers: str) -> httpx.Response:
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return httpx.post(f"{self.server.base_url}{path}", json=body, headers=headers, timeout=120)

    def send(self) -> None:
        # sampled, long enough that the text appears nowhere else in the log
        sampling = {"model": MODEL, "max_tokens": 12, "temperature": 1.5, "seed": 7, "ignore_eos": True}
        completion = self.post("/v1/completions", {**sampling, "prompt": f"The {self.prompt_word} said"}, self.key)
        assert completion.status_code == 200, completion.text
        self.outputs.append(completion.json()["choices"][0]["text"])
        messages = [{"role": "user", "content": f"Tell me about the {self.chat_word}."}]
        chat = self.post("/v1/chat/completions", {**sampling, "messages": messages}, self.key)
        assert chat.status_code == 200, chat.text
        self.outputs.append(chat.json()["choices"][0]["message"]["content"])
        self.outputs.append(self.stream({**sampling, "prompt": f"A {self.prompt_word} story:", "stream": True}))
        assert all(len(output.strip()) >= 10 for output in self.outputs), self.outputs
        for key, headers in ((self.wrong_key, {}), (None, {"X-Api-Key": self.key}), (None, {})):
            response = self.post("/v1/completions", {**sampling, "prompt": self.prompt_word}, key, **headers)
            assert response.status_code == 401
        basic = httpx.get(f"{self.server.base_url}/v1/models", headers={"Authorization": f"Basic {self.key}"})
        assert basic.status_code == 401
        for path in ("/health", "/metrics"):
            response = httpx.get(f"{self.server.base_url}{path}", headers={"Authorization": f"Bearer {self.key}"})
            assert response.is_success

    def stream(self, body: dict) -> str:
        text = ""
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.stream("POST", f"{self.server.base_url}/v1/completions", json=body, headers=headers,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choices = httpx.Response(200, content=line[6:]).json()["choices"]
                    text += "".join(choice["text"] for choice in choices)
        return text


def assert_the_log_was_verbose(log: str) -> None:
    """Debug lines and uvicorn's access log are there: the absences below are
    not those of a quiet log."""
    assert " DEBUG " in log, log[-2000:]
    assert '"POST /v1/completions HTTP/1.1" 200' in log and '"POST /v1/completions HTTP/1.1" 401' in log, log[-2000:]


def serve_traffic(*args: str):
    key = f"sk-{secrets.token_hex(16)}"
    server = ServerProcess("--api-key", key, *args, log_level="DEBUG", api_key=key)
    traffic = Traffic(server, key)
    try:
        traffic.send()
        yield traffic, server.read_log()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def quiet():
    yield from serve_traffic()


@pytest.fixture(scope="module")
def logged():
    yield from serve_traffic("--log-requests")


@pytest.mark.parametrize("which", ["quiet", "logged"])
def test_api_keys_are_never_logged(which, request):
    traffic, log = request.getfixturevalue(which)
    assert_the_log_was_verbose(log)
    assert traffic.key not in log
    assert traffic.wrong_key not in log


def test_prompts_and_outputs_are_not_logged_by_default(quiet):
    traffic, log = quiet
    for secret in (traffic.prompt_word, traffic.chat_word, *traffic.outputs):
        assert secret not in log, secret


def test_log_requests_logs_prompts_params_and_outputs(logged):
    traffic, log = logged
    prompt_lines = [line for line in log.splitlines() if ": prompt " in line]
    assert len(prompt_lines) == 3, prompt_lines
    assert any(traffic.prompt_word in line and "temperature=1.5" in line and "seed=7" in line
               for line in prompt_lines), prompt_lines
    assert any(traffic.chat_word in line for line in prompt_lines), prompt_lines
    assert all(" INFO heron.entrypoints.openai.request_log: request cmpl-" in line
               or " INFO heron.entrypoints.openai.request_log: request chatcmpl-" in line for line in prompt_lines)
    finished = [line for line in log.splitlines() if "output 0 finished (length)" in line]
    assert len(finished) == 3, finished
    for output in traffic.outputs:
        assert any(repr(output) in line for line in finished), (output, finished)


def test_log_requests_notes_a_stream_cut_short_which_is_still_aborted(logged):
    traffic, _ = logged
    server = traffic.server
    body = {"model": MODEL, "prompt": "Go on and on.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {traffic.key}"}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    wait_for(lambda: server.metric("heron:num_requests_running") == 0, 30, "the abandoned request to be aborted")
    wait_for(lambda: "ended before finishing" in server.read_log(), 10, "the log line of the cut-short request")
