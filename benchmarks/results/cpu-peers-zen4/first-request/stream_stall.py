"""The longest gap between a 900-token stream's chunks when the API server's first constrained
request arrives mid-stream. Start `heron serve --port 31021 --kv-cache-memory-bytes 256MiB
--max-model-len 1024`, then (from the repository root):

    .venv/bin/python benchmarks/results/cpu-peers-zen4/first-request/stream_stall.py constrained   # or: plain
"""

import sys
import threading
import time

import httpx

BASE = "http://127.0.0.1:31021/v1"
MODEL = "SmolLM2-135M-Instruct"
gaps: list[tuple[float, float]] = []  # (gap before a chunk, when it came)


def stream() -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "stream": True, "temperature": 0,
            "ignore_eos": True}
    last = None
    with httpx.stream("POST", BASE + "/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            now = time.monotonic()
            if line.startswith("data:"):
                if last is not None:
                    gaps.append((now - last, now))
                last = now


reader = threading.Thread(target=stream)
reader.start()
time.sleep(1.0)
sent = time.monotonic()
chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
if sys.argv[1] == "constrained":
    chat["structured_outputs"] = {"choice": ["yes", "no"]}
answer = httpx.post(BASE + "/chat/completions", json=chat, timeout=60)
print("second request", answer.status_code, f"took {time.monotonic() - sent:.2f} s")
reader.join()
before = max(gap for gap, at in gaps if at < sent)
after = max(gap for gap, at in gaps if at >= sent)
print("chunks", len(gaps), f"max gap before {before:.3f} s, max gap after the 2nd request {after:.3f} s")
