"""Start-up as a user sees it: seconds from the server command to its first
successful completion (a server that answers HTTP, or lists its models, may
still be loading). Works for any OpenAI-compatible server.

    python benchmarks/startup_time.py --url http://127.0.0.1:8000 -- heron serve --port 8000
    python benchmarks/startup_time.py --url URL --keep -- COMMAND...   # leave it running (prints its pid)

Prints one JSON line: {"seconds_to_first_completion", "seconds_to_models", "command"}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _get_json(url: str, body: dict | None = None, timeout: float = 30.0) -> dict | None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None


def wait_for_first_completion(url: str, started: float, process: subprocess.Popen, timeout: float) -> dict:
    """Poll until /v1/models lists a model and a one-token completion of it succeeds."""
    seconds_to_models = None
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before its first completion")
        models = _get_json(f"{url}/v1/models", timeout=2.0)
        if models and models.get("data"):
            if seconds_to_models is None:
                seconds_to_models = time.perf_counter() - started
            body = {"model": models["data"][0]["id"], "prompt": "Hello", "max_tokens": 1}
            if _get_json(f"{url}/v1/completions", body) is not None:
                return {"seconds_to_first_completion": round(time.perf_counter() - started, 2),
                        "seconds_to_models": round(seconds_to_models, 2)}
        time.sleep(0.05)
    raise SystemExit(f"no successful completion within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--keep", action="store_true", help="leave the server running")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result = wait_for_first_completion(args.url.rstrip("/"), started, process, args.timeout)
    finally:
        if not args.keep:
            process.terminate()
            process.wait(30)
    print(json.dumps({**result, "command": " ".join(command), **({"pid": process.pid} if args.keep else {})}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
