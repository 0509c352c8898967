"""Seconds of each completion of a fresh `heron serve` once /v1/models answers (run from the repository root):

    .venv/bin/python benchmarks/results/cpu-peers-zen4/first-request/first_request.py
"""

import json
import subprocess
import time
import urllib.request

URL = "http://127.0.0.1:8040"
MODEL = "SmolLM2-135M-Instruct"


def call(path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(URL + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


server = subprocess.Popen([".venv/bin/heron", "serve", "--port", "8040"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
started = time.perf_counter()
while True:
    try:
        if call("/v1/models").get("data"):
            break
    except OSError:
        pass
    time.sleep(0.05)
print("models", round(time.perf_counter() - started, 2))
tick = time.perf_counter()
call("/tokenize", {"prompt": "Hello"})
print("tokenize", round(time.perf_counter() - tick, 3))
for index in range(4):
    tick = time.perf_counter()
    call("/v1/completions", {"model": MODEL, "prompt": "Hello" if index < 3 else "Something else", "max_tokens": 1})
    print("completion", index, round(time.perf_counter() - tick, 3))
server.terminate()
server.wait()
