"""heron bench serve against a scripted server (aiohttp, on 127.0.0.1): an
answer of no text is an answer, the first error reported is a real one, runs
that measured nothing exit 1, several servers' results get a file each, and
bad arguments are usage errors, not tracebacks."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from heron.benchmarks.compare import load_results
from heron.entrypoints.cli import main


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


class ScriptedServer:
    """Answers /v1/completions per ``mode``: "text" (two chunks), "empty" (a
    finish chunk of no text, as an immediate end of sequence streams), or
    "fail_after:N" (N good answers, then 500s), "stall_after:N" (N good
    answers, then none for 5 s), "slow" (the second chunk after 1.5 s) or
    "usage" (a usage chunk: 50 prompt tokens, 2 completion tokens)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.answered = itertools.count()
        self.bodies: list[dict] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        number = next(self.answered)
        self.bodies.append(await request.json())
        if self.mode.startswith("fail_after:") and number >= int(self.mode.split(":")[1]):
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode.startswith("stall_after:") and number >= int(self.mode.split(":")[1]):
            await asyncio.sleep(5)  # no answer (for longer than the test waits)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "empty":
            await response.write(_chunk("", "stop"))
        else:
            await response.write(_chunk("Hello"))
            if self.mode == "slow":
                await asyncio.sleep(1.5)
            await response.write(_chunk(" world", "length"))
        if self.mode == "usage":
            usage = {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52}
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def scripted(request: pytest.FixtureRequest) -> Iterator[ScriptedServer]:
    with ScriptedServer(request.param) as server:
        yield server


def bench(*args: str) -> int:
    return main(["bench", "serve", "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4",
                 "--disable-tqdm", *args])


@pytest.mark.parametrize("scripted", ["empty"], indirect=True)
def test_an_answer_of_no_text_is_an_answer(scripted, tmp_path):
    """It was a failure ("the server returned no text"); vLLM's client counts it."""
    assert bench("--base-url", scripted.base_url, "--result-filename", str(tmp_path / "r.json")) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 0
    assert all(ttft > 0 for ttft in result["ttfts"])


@pytest.mark.parametrize("scripted", ["empty", "text"], indirect=True)
def test_a_server_that_ignores_ignore_eos_is_named(scripted, tmp_path, capsys):
    """Its outputs ended at end of sequence, shorter than asked, and nothing said so:
    its throughput and TPOT then compare unlike work (the setting was not saved either)."""
    assert bench("--base-url", scripted.base_url, "--ignore-eos", "--result-filename", str(tmp_path / "r.json")) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    warned = "4 of 4 requests ended before their length" in capsys.readouterr().err
    assert result["ignore_eos"] is True and warned == (scripted.mode == "empty")
    assert result["finish_reasons"] == ["stop" if scripted.mode == "empty" else "length"] * 4


@pytest.mark.parametrize("scripted", ["fail_after:1"], indirect=True)
def test_the_first_error_reported_is_a_real_one(scripted, capsys):
    """The first request succeeded, and the line read "first error: " (its empty error)."""
    assert bench("--base-url", scripted.base_url, "--max-concurrency", "1") == 0
    assert "3 requests failed; first error: HTTP 500" in capsys.readouterr().err


def test_a_run_that_measured_nothing_exits_1(tmp_path, capsys):
    assert bench("--base-url", "http://127.0.0.1:9", "--model", "x", "--result-filename",
                 str(tmp_path / "down.json")) == 1
    assert json.loads((tmp_path / "down.json").read_text())["failed"] == 4
    # its latencies are saved as 0 (as vLLM saves them), and shown as none: they read as the fastest run
    assert "Median TTFT (ms):                           -\n" in capsys.readouterr().out
    assert main(["bench", "compare", str(tmp_path / "down.json"), str(tmp_path / "down.json")]) == 0
    table = capsys.readouterr().out
    assert "| median_ttft_ms | - | - | - |" in table and "| completed | 0 | 0 | - |" in table, table
    # no --model and no server: a sentence, not aiohttp's traceback
    assert bench("--base-url", "http://127.0.0.1:9") == 2
    assert "cannot read the model name from http://127.0.0.1:9/v1/models" in capsys.readouterr().err


@pytest.mark.parametrize("scripted", ["text"], indirect=True)
def test_each_server_gets_its_own_result_file_and_unlabelled_runs_compare_by_file(scripted, tmp_path, capsys):
    """Two --base-url runs within one second wrote one default file name (the
    second overwrote the first), and compare labelled runs saved without
    --label all "None"."""
    assert bench("--base-url", scripted.base_url, "--base-url", scripted.base_url, "--save-result",
                 "--result-dir", str(tmp_path)) == 0
    files = sorted(str(path) for path in tmp_path.glob("*.json"))
    assert len(files) == 2 and files[0].endswith("-0.json") and files[1].endswith("-1.json")
    assert [result["label"] for result in load_results(files)] == files
    capsys.readouterr()
    assert main(["bench", "compare", *files]) == 0
    assert f"{files[1]} / {files[0]}" in capsys.readouterr().out


@pytest.mark.parametrize("scripted", ["text"], indirect=True)
def test_sampling_flags_go_into_every_request_and_the_result(scripted, tmp_path):
    """--top-p, --top-k and --min-p (vLLM's bench flags) are sent when given, and
    not otherwise: a run could only measure greedy or plain temperature before."""
    result_file = str(tmp_path / "r.json")
    assert bench("--base-url", scripted.base_url, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "50",
                 "--result-filename", result_file) == 0
    assert len(scripted.bodies) == 4
    assert all((b["temperature"], b["top_p"], b["top_k"]) == (0.7, 0.9, 50) for b in scripted.bodies)
    assert all("min_p" not in b for b in scripted.bodies)
    assert json.loads(open(result_file).read())["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 50}
    scripted.bodies.clear()
    assert bench("--base-url", scripted.base_url) == 0
    sent = [sorted(set(body) & {"temperature", "top_p", "top_k", "min_p"}) for body in scripted.bodies]
    assert sent == [["temperature"]] * 4


@pytest.mark.parametrize("args", [
    ["serve", "--request-rate", "0"],
    ["serve", "--burstiness", "0"],
    ["serve", "--max-concurrency", "0"],
    ["serve", "--dataset-name", "prefix-repetition", "--prefix-repetition-num-prefixes", "0"],
    ["serve", "--num-prompts", "0"],
    ["throughput", "--output-len", "0"],
    ["latency", "--num-iters", "0"],
    ["latency", "--batch-size", "x"],
    ["serve", "--top-p", "0"],
    ["serve", "--top-p", "1.5"],
    ["serve", "--top-k", "-2"],
    ["serve", "--min-p", "nan"],
    ["serve", "--temperature", "-1"],
])
def test_bad_arguments_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", *args])
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


@pytest.mark.parametrize("scripted", ["stall_after:2"], indirect=True)
def test_ctrl_c_keeps_what_finished(scripted, tmp_path, capsys):
    """A stalled request held the run, and Ctrl-C then lost every result."""
    import os
    import signal

    def interrupt_once_stalled() -> None:  # a fixed delay could end before the run began, on a busy machine
        deadline = time.monotonic() + 60
        while len(scripted.bodies) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_stalled, daemon=True).start()
    path = tmp_path / "r.json"
    assert bench("--base-url", scripted.base_url, "--max-concurrency", "1", "--result-filename", str(path)) == 130
    [result] = load_results([str(path)])
    assert result["completed"] == 2 and result["interrupted"] is True
    assert "interrupted: 2 of 4 requests finished" in capsys.readouterr().err


@pytest.mark.parametrize("scripted", ["text"], indirect=True)
def test_warm_up_requests_are_sent_first_and_not_counted(scripted, tmp_path):
    path = tmp_path / "r.json"
    assert bench("--base-url", scripted.base_url, "--num-warmups", "2", "--result-filename", str(path)) == 0
    [result] = load_results([str(path)])
    assert len(scripted.bodies) == 6 and result["completed"] == 4 and result["num_warmups"] == 2


@pytest.mark.parametrize("scripted", ["slow"], indirect=True)
def test_only_request_timeout_bounds_a_request(scripted, tmp_path, monkeypatch):
    """aiohttp's session-wide default timeout (300 s for a whole request; 1 s
    here) cut every longer request, reported as over --request-timeout (6 h)."""
    import aiohttp

    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=1.0))
    path = tmp_path / "r.json"
    assert bench("--base-url", scripted.base_url, "--num-prompts", "1", "--result-filename", str(path)) == 0
    [result] = load_results([str(path)])
    assert (result["completed"], result["failed"]) == (1, 0), result["errors"]
    assert bench("--base-url", scripted.base_url, "--num-prompts", "1", "--request-timeout", "0.5",
                 "--result-filename", str(path)) == 1
    [result] = load_results([str(path)])
    assert result["errors"] == ["no whole answer within --request-timeout (0.5 s)"]


@pytest.mark.parametrize("scripted", ["usage"], indirect=True)
def test_input_tokens_are_the_servers_count_when_it_sends_one(scripted, tmp_path):
    """The dataset's count leaves out what the server adds (a chat template's
    tokens: half the real figure on the chat endpoint), as vLLM's client does not."""
    path = tmp_path / "r.json"
    assert bench("--base-url", scripted.base_url, "--result-filename", str(path)) == 0
    [result] = load_results([str(path)])
    assert result["total_input_tokens"] == 4 * 50 and result["input_lens"] == [50] * 4
    assert result["total_output_tokens"] == 4 * 2


@pytest.mark.parametrize("scripted", ["text"], indirect=True)
def test_another_models_prompts_counted_with_the_embedded_tokenizer_are_said_to_be(scripted, tmp_path, capsys):
    assert bench("--base-url", scripted.base_url) == 0  # the server's model, "scripted"
    assert "counted with the embedded SmolLM2-135M-Instruct tokenizer, not 'scripted''s" in capsys.readouterr().err
    assert bench("--base-url", scripted.base_url, "--model", "SmolLM2-135M-Instruct") == 0
    assert "counted with the embedded" not in capsys.readouterr().err
