"""Run `heron serve` as a real subprocess on a free loopback port for tests."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0,
        tls_cert: str | None = None, wait_ready: bool = True, port: int | None = None, log_level: str | None = None,
        api_key: str | None = None, launcher: Sequence[str] = ("-m", "heron.entrypoints.cli"),
    ) -> None:
        """``tls_cert``: the server's certificate (or the CA that signed it), when
        it serves HTTPS; ``wait_ready`` False returns at once (then
        ``wait_ready()`` waits); ``port``: a given one (a replica restarted where
        a router expects it); ``log_level``: heron's ``--log-level``;
        ``api_key``: sent with the probes of /health and /metrics (``--protect-metrics``);
        ``launcher``: the interpreter's arguments that run heron's command line
        (a ``-c`` script that wraps it, with its own arguments first)."""
        self.port = port or free_port()
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=tls_cert) if tls_cert else True
        self.base_url = f"{'https' if tls_cert else 'http'}://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="heron-serve-", suffix=".log", delete=False)
        command = [sys.executable, *launcher, *(["--log-level", log_level] if log_level else []),
                   "serve", "--port", str(self.port), "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "1024",
                   *args]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        if wait_ready:
            self.wait_ready(startup_timeout)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"heron serve exited early:\n{self.read_log()}")
            try:
                health = httpx.get(f"{self.base_url}/health", timeout=1.0, verify=self.verify, headers=self.headers)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.read_log()  # before stop() deletes it
        self.stop()
        raise RuntimeError(f"heron serve did not become ready:\n{log}")

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def engine_core_pid(self, timeout: float = 0.0) -> int:
        """The engine-core child process of this server (waiting up to ``timeout`` s for it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._child_pid()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _child_pid(self) -> int:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid:
                return int(entry)
        raise RuntimeError("engine core process not found")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples from /metrics, over label sets that include ``labels``."""
        response = httpx.get(f"{self.base_url}/metrics", timeout=5, headers=self.headers)
        response.raise_for_status()
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        total = 0.0
        found = False
        for line in response.text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                found = True
                if all(item in line for item in wanted):
                    total += float(line.rsplit(" ", 1)[1])
        if not found:  # a missing metric is a failure, never a silent zero
            raise AssertionError(f"{name} is not in /metrics:\n{response.text[:2000]}")
        return total

    def connections(self) -> list[int]:
        """The send-queue length (bytes not yet taken by the client) of each
        established TCP connection this server holds on its port."""
        queues = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as handle:
                for line in handle.readlines()[1:]:
                    fields = line.split()  # sl, local address:port, remote, state, tx_queue:rx_queue, ...
                    if int(fields[1].rsplit(":", 1)[1], 16) == self.port and fields[3] == "01":
                        queues.append(int(fields[4].split(":")[0], 16))
        return queues

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()
        os.unlink(self.log.name)


def descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid``, with its command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    commands[int(entry)] = cmdline.read().replace(b"\0", b" ").decode()
            except (OSError, ValueError):
                continue
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found


def wait_for(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def complete_together(base_url: str, count: int, max_tokens: int = 16) -> None:
    """``count`` short completions sent at once (each from its own thread), all
    of which must succeed: load counted at send spreads them over engines."""
    import threading

    failures: list[str] = []

    def complete(index: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"{index} herons", "max_tokens": max_tokens,
                "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        if response.status_code != 200:
            failures.append(f"{response.status_code}: {response.text[:200]}")

    workers = [threading.Thread(target=complete, args=(index,)) for index in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not failures, failures
