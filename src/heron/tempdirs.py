"""Private temporary directories (IPC sockets, start pickles, the shared
gateway file, multiprocess metrics, kernel builds) that do not outlive a
process killed outright.

A process removes its directories when it stops; a SIGKILL or a crash gives it
no chance. So each directory holds a lock file its creator keeps an exclusive
``flock`` on for as long as it lives: the kernel drops the lock when the
process dies, however it dies. Whoever makes a new private directory first
sweeps the temporary directory for heron's directories whose lock can be
taken, and removes them: their owners are gone.

Invariants: a directory is swept only once its lock file exists and is not
locked; the lock file appears already locked (it is locked under a temporary
name, then renamed into place), so a directory being made is never swept. A
directory without a lock file (being made, or made by an older heron) is left
alone. Only the current user's directories are looked at."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import threading

IPC_DIR_PREFIX = "heron-ipc-"  # an engine core's sockets (its orphan check removes only such a directory)
PREFIXES = (IPC_DIR_PREFIX, "heron-dp-", "heron-api-", "heron-kernels-")
LOCK_NAME = ".owner.lock"

_lock = threading.Lock()
_held: dict[str, int] = {}  # directory -> the descriptor holding its lock, for this process's life


def make_private_dir(prefix: str) -> str:
    """A new directory under the temporary directory, locked as this process's
    (``prefix``: one of ``PREFIXES``), after sweeping stale ones."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown private directory prefix {prefix!r}")
    sweep_stale_dirs()
    directory = tempfile.mkdtemp(prefix=prefix)
    pending = os.path.join(directory, f"{LOCK_NAME}.{os.getpid()}")
    descriptor = os.open(pending, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(pending, os.path.join(directory, LOCK_NAME))
    with _lock:
        _held[directory] = descriptor
    return directory


def remove_private_dir(directory: str) -> None:
    """Remove a directory (made by ``make_private_dir`` or not) and let go of its lock."""
    shutil.rmtree(directory, ignore_errors=True)
    with _lock:
        descriptor = _held.pop(directory, None)
    if descriptor is not None:
        os.close(descriptor)


def sweep_stale_dirs(root: str | None = None) -> list[str]:
    """Remove heron's private directories under ``root`` (the temporary
    directory) whose owner has died; returns those removed."""
    root = root or tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(root) if name.startswith(PREFIXES)]
    except OSError:
        return []
    removed = []
    for name in names:
        directory = os.path.join(root, name)
        if _is_stale(directory):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def _is_stale(directory: str) -> bool:
    """True when ``directory`` is a directory (not a link) of this user's and its
    lock file exists unlocked."""
    with _lock:
        if directory in _held:
            return False
    try:
        status = os.lstat(directory)
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
            return False
        descriptor = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # gone, not a directory, no lock file (being made, or an older heron's)
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its owner lives
    finally:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    return True
