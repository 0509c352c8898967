"""Run `heron router` as a real subprocess on a free loopback port for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from tests.e2e.server_process import free_port


class RouterProcess:
    def __init__(self, replicas: list[str], *args: str, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="heron-router-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "heron.entrypoints.cli", "router", "--port", str(self.port),
                   "--probe-interval", "0.2", *args]
        for url in replicas:
            command += ["--replica", url]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"heron router exited early:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.read_log()
        self.stop()
        raise RuntimeError(f"heron router did not become ready:\n{log}")

    def replicas(self) -> dict[str, dict]:
        states = httpx.get(f"{self.base_url}/router/replicas", timeout=5).json()["replicas"]
        return {state["url"]: state for state in states}

    def read_log(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()
        os.unlink(self.log.name)
