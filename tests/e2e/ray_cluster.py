"""A real two-node Ray cluster on loopback for tests: `ray start --head` and
`ray start --address` as two processes on this machine (each `--block`, so
stopping the process stops its node's Ray processes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from tests.e2e.server_process import free_port


class RayCluster:
    def __init__(self, cpus_per_node: int = 1, timeout: float = 120.0) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.logs: list[tempfile._TemporaryFileWrapper[str]] = []
        self.nodes: list[subprocess.Popen[bytes]] = []
        try:
            self._start(["--head", "--port", str(self.port), "--include-dashboard=false"], cpus_per_node)
            self._start(["--address", self.address], cpus_per_node)
            self._wait_for_nodes(2, timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, where: list[str], cpus: int) -> None:
        ports = [arg for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                                  "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
                 for arg in (flag, str(free_port()))]
        log = tempfile.NamedTemporaryFile("w+", prefix="heron-ray-", suffix=".log", delete=False)
        self.logs.append(log)
        # a small object store: heron passes nothing through it, and CI machines may have a small /dev/shm
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", *where, "--num-cpus", str(cpus),
                   "--object-store-memory", str(100 << 20), "--disable-usage-stats", "--block", *ports]
        self.nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _wait_for_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.poll() is not None:
                    raise RuntimeError(f"a Ray node exited early:\n{self.read_logs()}")
            status = self.status()
            if sum(line.strip().startswith("1 node_") for line in status.splitlines()) >= count:
                return
            time.sleep(1.0)
        raise RuntimeError(f"the Ray cluster did not get {count} nodes:\n{status}\n{self.read_logs()}")

    def status(self) -> str:
        return subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", "--address", self.address],
                              capture_output=True, text=True, env=self.env, timeout=60).stdout

    def cpus_in_use(self) -> float:
        """From `ray status`: the CPUs reserved by actors and placement groups."""
        match = re.search(r"([0-9.]+)/[0-9.]+ CPU", self.status())
        if match is None:
            raise AssertionError(f"no CPU line in ray status:\n{self.status()}")
        return float(match.group(1))

    def read_logs(self) -> str:
        texts = []
        for log in self.logs:
            with open(log.name, encoding="utf-8", errors="replace") as handle:
                texts.append(handle.read()[-4000:])
        return "\n".join(texts)

    def stop(self) -> None:
        """Worker node first, then the head (each `ray start --block` stops its node's processes)."""
        for node in reversed(self.nodes):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)
                try:
                    node.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(node.pid, signal.SIGKILL)
                    node.wait(10)
        for log in self.logs:
            log.close()
            os.unlink(log.name)
