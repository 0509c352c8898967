"""The chat page (GET /) in a real headless browser, Debian's chromium driven
by Playwright, against a live server on the embedded model (issue #21, item
3): a question typed and sent streams its answer into the page, the next one
carries the conversation, the system prompt and temperature reach the
request, Stop ends a stream mid-way (and the server aborts its request), and
a server with API keys gets the key field. A failed answer leaves its
question out of the conversation and gives its text back; a cut one keeps
its words; empty settings are left out; a reader scrolled up stays there."""

from __future__ import annotations

import json
import time

import httpx

from tests.e2e.conftest import needs_chromium
from tests.e2e.server_process import ServerProcess

pytestmark = needs_chromium


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
    """Also under --protect-metrics, which locked the page itself away."""
    server = ServerProcess("--max-model-len", "2048", "--api-key", "page-key", "--protect-metrics",
                           api_key="page-key")
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


def fulfilled_chat(page, status: int, body: str) -> list[dict]:
    """Answer the page's chat requests with ``body`` (an SSE stream for 200, a
    JSON error else); returns the requests' bodies as sent."""
    sent: list[dict] = []

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=status, body=body,
                      content_type="text/event-stream" if status == 200 else "application/json")

    page.route("**/v1/chat/completions", answer)
    return sent


def sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(event)}\n\n" for event in events)


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def open_page(browser, server):
    page = browser.new_page()
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('SmolLM2')")
    return page


def test_a_failed_answer_gives_its_question_back_and_a_cut_one_keeps_its_words(browser, default_server):
    """The input was cleared and the question dropped from the conversation
    while its bubble stayed, so the screen showed what the model never saw; an
    error mid-answer replaced the words already shown with the error's text."""
    page = open_page(browser, default_server)
    too_long = json.dumps({"error": {"message": "This model's maximum context length is 1024 tokens.",
                                     "type": "BadRequestError", "param": "messages", "code": None}})
    sent = fulfilled_chat(page, 400, too_long)
    ask(page, "A very long question")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert page.input_value("#input") == "A very long question"
    assert "not in the conversation" in page.locator(".message.user").last.inner_text()
    assert "maximum context length" in page.locator(".message.error").last.inner_text()
    page.unroute("**/v1/chat/completions")

    cut = sse(delta("Herons "), delta("wade"), {"error": {"message": "the engine stopped", "code": 500}})
    sent = fulfilled_chat(page, 200, cut)
    ask(page, "Tell me about herons")
    page.wait_for_function("!document.getElementById('send').disabled")
    answer = last_answer(page)
    assert answer.startswith("Herons wade") and "(the answer was cut: the engine stopped)" in answer
    assert sent[-1]["messages"] == [{"role": "user", "content": "Tell me about herons"}]  # the failed one left out

    page.unroute("**/v1/chat/completions")
    fulfilled_chat(page, 200, sse(delta("Herons "), delta("wait")))  # closed cleanly, but before its finish
    ask(page, "And then?")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert last_answer(page).startswith("Herons wait") and "(the answer ended early" in last_answer(page)

    empty = sse({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]})
    page.unroute("**/v1/chat/completions")
    sent = fulfilled_chat(page, 200, empty)
    ask(page, "Say nothing")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert "(empty answer)" in last_answer(page) and page.input_value("#input") == "Say nothing"
    page.close()


def test_empty_settings_are_left_out_and_invalid_ones_send_nothing(browser, default_server):
    """An empty temperature went out as 0 (greedy without a word) and an empty
    token limit as 0 (a 400)."""
    page = open_page(browser, default_server)
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    sent = fulfilled_chat(page, 200, sse(delta("Hi"), done))
    page.fill("#temperature", "")
    page.fill("#max-tokens", "")
    ask(page, "Hello")
    page.wait_for_function("!document.getElementById('send').disabled")
    assert "temperature" not in sent[-1] and "max_tokens" not in sent[-1], sent[-1]
    page.fill("#temperature", "5")  # above the field's max of 2
    ask(page, "Hello again")
    time.sleep(0.5)
    assert len(sent) == 1 and page.input_value("#input") == "Hello again"
    page.close()


def test_a_reader_scrolled_up_is_left_there_while_the_answer_streams(browser, default_server):
    """Every token scrolled the conversation to its end, so a long answer could
    not be read back while it streamed."""
    page = browser.new_page(viewport={"width": 500, "height": 360})
    start_a_long_answer(page, default_server)
    page.wait_for_function("(m => m.scrollHeight > m.clientHeight + 150)(document.getElementById('messages'))",
                           timeout=120_000)
    page.evaluate("document.getElementById('messages').scrollTop = 0")
    grown = page.evaluate("document.getElementById('messages').scrollHeight")
    page.wait_for_function(f"document.getElementById('messages').scrollHeight > {grown} + 40", timeout=60_000)
    assert page.evaluate("document.getElementById('messages').scrollTop") == 0
    page.click("#stop")
    page.close()


def test_a_long_answer_is_drawn_at_the_pace_it_comes(browser, default_server):
    """Each token read the scroll position and so laid the whole answer out
    again: the time to show 8,000 tokens arriving at once grew with the square of their length (the page, not the
    server, set the pace, and the tok/s shown was the page's). Also an event
    stream with CRLF line ends (a proxy's rewrite) is read: it showed nothing."""
    page = open_page(browser, default_server)
    tokens = 8000
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    body = sse(*(delta(f"w{i} ") for i in range(tokens)), done).replace("\n", "\r\n")
    fulfilled_chat(page, 200, body)
    started = time.monotonic()
    ask(page, "Go on for a while")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=120_000)
    assert time.monotonic() - started < 40  # a bound the old page missed by far
    answer = last_answer(page)
    assert answer.startswith("w0 w1 ") and f"w{tokens - 1} " in answer and "(stopped at the token limit)" in answer
    page.close()


def test_a_second_question_waits_for_the_first_while_the_model_name_is_asked(browser, default_server):
    """With /v1/models slow, a question sent meanwhile was not "running" yet: a
    second one ran beside it (two user turns in a row), and Stop ended only the
    second, leaving the first streaming with no way to stop it."""
    page = browser.new_page()
    held: list = []
    page.route("**/v1/models", lambda route: held.append(route))  # never answered until the test says so
    page.goto(default_server.base_url + "/")
    sent = fulfilled_chat(page, 200, sse(delta("Hi"), {"choices": [{"index": 0, "delta": {},
                                                                     "finish_reason": "stop"}]}))
    ask(page, "one")
    page.wait_for_function("document.getElementById('send').disabled")
    ask(page, "two")  # refused while the first is under way: it stays in the input
    assert page.input_value("#input") == "two"
    page.unroute("**/v1/models")
    for route in held:
        route.continue_()
    page.wait_for_function("!document.getElementById('send').disabled", timeout=30_000)
    assert [body["messages"] for body in sent] == [[{"role": "user", "content": "one"}]]
    page.close()


def test_a_chat_refused_for_its_key_shows_the_key_field(browser, default_server):
    """A server restarted with keys after the page loaded: the field stayed
    hidden and the page had to be reloaded to enter one."""
    page = open_page(browser, default_server)
    refusal = json.dumps({"error": {"message": "Incorrect or missing API key", "type": "authentication_error",
                                    "param": None, "code": "invalid_api_key"}})
    fulfilled_chat(page, 401, refusal)
    ask(page, "Hello")
    page.wait_for_selector("#key-row", state="visible")
    assert "API key" in page.inner_text("#model")
    page.close()
