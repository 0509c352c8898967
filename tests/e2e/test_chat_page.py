"""The chat page (GET /) in a real headless browser, Debian's chromium driven
by Playwright, against a live server on the embedded model (issue #21, item
3): a question typed and sent streams its answer into the page, the next one
carries the conversation, the system prompt and temperature reach the
request, Stop ends a stream mid-way (and the server aborts its request), and
a server with API keys gets the key field."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from tests.e2e.server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `make setup` installs Debian's as root")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def chat_requests(page) -> list[dict]:
    """The bodies of the chat requests the page sends, as it sends them."""
    sent: list[dict] = []
    page.on("request", lambda request: sent.append(json.loads(request.post_data))
            if request.url.endswith("/v1/chat/completions") else None)
    return sent


def ask(page, question: str) -> None:
    page.fill("#input", question)
    page.press("#input", "Enter")


def start_a_long_answer(page, server) -> None:
    """Open the page and ask for a long answer; return once it is streaming."""
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('SmolLM2')")
    page.fill("#max-tokens", "1500")
    ask(page, "Write a very long story about a heron.")
    page.wait_for_function("document.querySelectorAll('.message.assistant')[0].textContent.length > 20",
                           timeout=60_000)


def last_answer(page) -> str:
    return page.locator(".message.assistant").last.inner_text()


def test_a_question_streams_its_answer_and_the_conversation_carries_on(browser, default_server):
    page = browser.new_page()
    sent = chat_requests(page)
    page.goto(default_server.base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'SmolLM2-135M-Instruct'")
    page.fill("#system", "You are a geography teacher.")
    page.fill("#temperature", "0")
    ask(page, "What is the capital of Japan?")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)
    assert "Tokyo" in last_answer(page)
    assert "tok/s" in page.inner_text("#stats")
    ask(page, "And of Germany?")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 2 && "
                           "!document.getElementById('send').disabled", timeout=60_000)
    assert "Berlin" in last_answer(page)
    first, second = sent
    assert first["stream"] is True and first["temperature"] == 0
    assert first["messages"] == [{"role": "system", "content": "You are a geography teacher."},
                                 {"role": "user", "content": "What is the capital of Japan?"}]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert "Tokyo" in second["messages"][2]["content"]
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    page.close()


def test_stop_ends_the_stream_and_the_server_aborts_it(browser, default_server):
    page = browser.new_page()
    start_a_long_answer(page, default_server)
    page.click("#stop")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert "(stopped)" in last_answer(page)
    text = last_answer(page)
    time.sleep(1.0)
    assert last_answer(page) == text  # nothing more arrives
    deadline = time.monotonic() + 10
    while default_server.metric("heron:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the stopped request is still running"
        time.sleep(0.2)
    page.close()


def test_new_chat_and_stop_leave_no_trace_in_the_next_request(browser, default_server):
    """New chat while an answer streamed put that answer into the new chat's
    history (the aborted send pushed it after the reset), and Stop before the
    first token sent the page's note "(stopped)" to the model as its answer."""
    page = browser.new_page()
    sent = chat_requests(page)
    start_a_long_answer(page, default_server)
    page.click("#new-chat")
    page.wait_for_function("!document.getElementById('send').disabled")
    # the next answer is held before its first byte (the route never continues), then stopped
    held: list = []
    page.route("**/v1/chat/completions", lambda route: held.append(route))
    ask(page, "Say nothing yet.")
    page.wait_for_function("document.getElementById('stop').disabled === false")
    page.click("#stop")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert "(stopped)" in last_answer(page)
    page.unroute("**/v1/chat/completions")
    page.fill("#max-tokens", "8")
    ask(page, "Hi")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 2 && "
                           "!document.getElementById('send').disabled", timeout=60_000)
    assert sent[-1]["messages"] == [{"role": "user", "content": "Hi"}], sent[-1]["messages"]
    page.close()


def test_a_server_out_of_reach_at_first_is_waited_for(browser, default_server):
    """A network error while the page asked for the model name ended its retries
    (an uncaught rejection), and the first question sent then vanished."""
    page = browser.new_page()
    failures = {"left": 2}

    def flaky(route):
        if failures["left"]:
            failures["left"] -= 1
            route.abort("connectionrefused")
        else:
            route.continue_()

    page.route("**/v1/models", flaky)
    page.goto(default_server.base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'SmolLM2-135M-Instruct'",
                           timeout=30_000)
    assert failures["left"] == 0
    page.close()


def test_a_server_with_keys_gets_the_key_field(browser):
    server = ServerProcess("--max-model-len", "2048", "--api-key", "page-key")
    try:
        assert httpx.get(server.base_url + "/").status_code == 200  # the page itself holds nothing secret
        page = browser.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_selector("#key-row", state="visible")
        page.fill("#api-key", "page-key")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.getElementById('model').textContent === 'SmolLM2-135M-Instruct'")
        page.fill("#temperature", "0")
        ask(page, "What is the capital of Japan?")
        page.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)
        assert "Tokyo" in last_answer(page)
        page.close()
    finally:
        server.stop()
