"""Cross-origin requests in a real browser (Debian's chromium, driven by
Playwright): a page served from another origin calls a live ``heron serve``
started with ``--allowed-origins``. The named origin streams a chat answer
(its preflight answered without the API key) and reads the gateway's 401; a
page from an origin not named can read nothing."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import needs_chromium
from tests.e2e.server_process import ServerProcess, free_port

pytestmark = needs_chromium

KEY = "cors-key"
# what a web app's page runs: a streamed chat request with its key (a JSON body and an Authorization header
# make the browser send a preflight first)
FETCH_CHAT = """async ([url, key]) => {
  try {
    const response = await fetch(url + '/v1/chat/completions', {
      method: 'POST',
      headers: {'Content-Type': 'application/json', 'Authorization': 'Bearer ' + key},
      body: JSON.stringify({model: 'SmolLM2-135M-Instruct',
                            messages: [{role: 'user', content: 'What is the capital of Japan?'}],
                            max_tokens: 16, temperature: 0, stream: true}),
    });
    return {status: response.status, body: await response.text()};
  } catch (error) {
    return {error: String(error)};
  }
}"""


class _Blank(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the handler's name is http.server's)
        body = b"<!doctype html><title>app</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def page_origin() -> Iterator[str]:
    """A blank page's origin: a web app served from another port than heron's."""
    port = free_port()
    origin_server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Blank)
    thread = threading.Thread(target=origin_server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        origin_server.shutdown()
        origin_server.server_close()


allowed_origin = pytest.fixture(scope="module")(page_origin)
other_origin = pytest.fixture(scope="module")(page_origin)


@pytest.fixture(scope="module")
def cors_server(allowed_origin):
    process = ServerProcess("--api-key", KEY, "--allowed-origins", allowed_origin, api_key=KEY)
    yield process
    process.stop()


def fetch_from(browser, origin: str, server: ServerProcess, key: str) -> dict:
    page = browser.new_page()
    try:
        page.goto(origin + "/")
        return page.evaluate(FETCH_CHAT, [server.base_url, key])
    finally:
        page.close()


def test_a_named_origin_streams_an_answer_and_reads_a_refusal(browser, allowed_origin, cors_server):
    result = fetch_from(browser, allowed_origin, cors_server, KEY)
    assert result.get("status") == 200, result
    assert "Tokyo" in result["body"] and result["body"].rstrip().endswith("data: [DONE]")
    refused = fetch_from(browser, allowed_origin, cors_server, "wrong-key")
    assert refused.get("status") == 401 and "authentication_error" in refused["body"], refused


def test_an_origin_not_named_reads_nothing(browser, other_origin, cors_server):
    result = fetch_from(browser, other_origin, cors_server, KEY)
    assert "error" in result and "Failed to fetch" in result["error"], result


def test_a_page_may_read_retry_after(allowed_origin, cors_server):
    """A 429's or a 503's Retry-After was not exposed to the page."""
    import httpx

    answer = httpx.get(f"{cors_server.base_url}/v1/models", headers={"Origin": allowed_origin,
                                                                      "Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200
    assert "retry-after" in answer.headers["access-control-expose-headers"].lower()
