"""``heron router --ray-address``: the heron servers registered on a Ray cluster,
listed by a child process.

The router never joins the cluster itself. A Ray driver whose cluster goes
away is ended by Ray (a router exited 0 about a minute after its cluster's
head stopped, though it had healthy ``--replica`` servers of its own), and a
listing that hung held up every probe round. A child process joins instead and
writes the list as one JSON line every interval; the router keeps the last
list it read, and starts a child again when one ends (the cluster gone, or
restarting): after ``RESTART_DELAY_S``, twice that after a child that listed
nothing, and so on up to a minute.

    python -m heron.router.ray_discovery ADDRESS INTERVAL_SECONDS
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time

logger = logging.getLogger(__name__)

RESTART_DELAY_S = 5.0
MAX_RESTART_DELAY_S = 60.0
FIRST_LIST_TIMEOUT_S = 60.0  # joining a cluster takes a few seconds; a first round waits this long at most


class RayDiscovery:
    """The ``discover`` of a ``ReplicaSet``: the last list a child process wrote."""

    def __init__(self, address: str, interval_s: float, command: list[str] | None = None) -> None:
        """``command``: the child to run (default: this module on ``address``)."""
        self.command = command or [sys.executable, "-m", "heron.router.ray_discovery", address, str(interval_s)]
        self.address = address
        self._latest: list[str] = []
        self._first_list = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._child: asyncio.subprocess.Process | None = None
        self._lists_read = 0

    async def __call__(self) -> list[str]:
        if self._task is None:
            self._task = asyncio.create_task(self._run_children(), name="heron-ray-discovery")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_LIST_TIMEOUT_S):
                    await self._first_list.wait()
        return list(self._latest)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self._stop_child()

    async def _run_children(self) -> None:
        delay = RESTART_DELAY_S
        while True:
            listed = self._lists_read
            try:
                await self._run_child(delay)
            except Exception as exc:  # noqa: BLE001 (no child could start: try again later)
                logger.warning("Ray discovery at %s could not run: %r", self.address, exc)
            finally:
                await self._stop_child()
            self._first_list.set()  # a first round goes on with what it has
            await asyncio.sleep(delay)
            # a child that listed nothing (no cluster there) waits twice as long before the next, up to a minute
            delay = RESTART_DELAY_S if self._lists_read > listed else min(2 * delay, MAX_RESTART_DELAY_S)

    async def _run_child(self, delay: float) -> None:
        self._child = child = await asyncio.create_subprocess_exec(*self.command, stdout=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        while line := await child.stdout.readline():
            try:
                message = json.loads(line)
                replicas = message.get("replicas")
            except (ValueError, AttributeError):
                logger.warning("Ray discovery wrote a line it should not: %r", line[:200])
                continue
            if isinstance(replicas, list) and all(isinstance(url, str) for url in replicas):
                self._latest = replicas
                self._lists_read += 1
                self._first_list.set()
            elif "error" in message:
                logger.warning("Ray discovery at %s: %s", self.address, message["error"])
        code = await child.wait()
        logger.warning("Ray discovery at %s ended (code %s): keeping the %d server(s) it last listed, "
                       "starting it again in %g s or more", self.address, code, len(self._latest), delay)

    async def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.returncode is None:
            child.kill()
        await child.wait()  # its pipes closed here, not by the collector after the loop has gone


def main(argv: list[str]) -> int:
    address, interval = argv[0], float(argv[1])
    from heron.engine.ray_engines import connect, discover_replicas

    try:
        connect(address)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    while True:
        try:
            print(json.dumps({"replicas": discover_replicas()}), flush=True)
        except BrokenPipeError:  # the router is gone
            return 0
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
