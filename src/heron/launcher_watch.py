"""A child process that ends when the process that started it is gone.

An engine core and the API servers of ``--api-server-count`` are started by a
launcher that stops them when it stops; killed outright (SIGKILL, the OOM
killer), it stops nothing, and its children are re-parented. Each child is told
its launcher's PID on its command line and watches for its parent to be any
other process. The PID is passed, not read with ``getppid()`` when the watch
starts: a child's imports (torch, the model code) take seconds, and a launcher
killed in that time left a child whose "parent" was already init, which it
then watched for ever (an engine core loaded its model and held it, and an API
server with it answered requests with no launcher left)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0


def exit_when_launcher_gone(launcher_pid: int, cleanup: Callable[[], None] = lambda: None,
                            what: str = "process") -> None:
    """Check now, then every second on a daemon thread, that this process's
    parent is ``launcher_pid``; when it is not, run ``cleanup`` (what only this
    process can still remove) and exit at once, without the interpreter's
    shutdown (the launcher's children are not waited on by anyone)."""
    def watch() -> None:
        while True:
            if os.getppid() != launcher_pid:
                logger.warning("%s %d: its launcher (pid %d) is gone; exiting", what, os.getpid(), launcher_pid)
                try:
                    cleanup()
                finally:
                    os._exit(0)
            time.sleep(WATCH_INTERVAL_S)

    threading.Thread(target=watch, name="heron-launcher-watch", daemon=True).start()
