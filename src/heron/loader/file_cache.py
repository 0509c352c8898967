"""Files heron derives from a checkpoint and keeps between starts, under
``~/.cache/heron/weights`` (``HERON_CACHE_DIR``): a GGUF file's dequantized
tensors (``loader/weights.py``) and a low-bit model's packed layers
(``models/packed_cache.py``).

An entry is named ``SOURCE-VERSION.KIND.safetensors``: SOURCE a hash of the
checkpoint's paths, VERSION a hash of everything the contents depend on (file
sizes and modification times, formats, code). Each write removes what no start
is likely to read: of the same checkpoint and kind, every other VERSION but the
newest (the file changed, or heron's packing did; one older version is kept so
that two heron trees run in turns, as a comparison does, do not rebuild each
other's entry at every start), entries whose checkpoint is gone (a deleted
download, a test's temporary file), files named before this scheme, and partial
files whose writer died (killed mid-write: up to 0.5 GB each).
Without that, every reinstall of the embedded model left 0.5 GB behind (a
development machine here had gathered 6.4 GB). Writes are atomic: readers never
see half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time

import torch

from heron import envs

logger = logging.getLogger(__name__)
_ENTRY = re.compile(r"^([0-9a-f]{12})-([0-9a-f]{16})\.([a-z0-9]+)\.safetensors$")
_PARTIAL = re.compile(r"\.safetensors\.(\d+)\.partial$")  # save_entry's file while it writes, with its pid
# a partial file untouched this long, whose writer is not a live process here, was abandoned (a write takes
# seconds; the age also spares a writer on another machine sharing the directory, whose pid means nothing here)
ABANDONED_AFTER_S = 600.0


def entry_path(kind: str, sources: list[str], version: str) -> str | None:
    """The entry of ``kind`` for the checkpoint files ``sources`` in this
    ``version`` (their sizes, modification and change times and inodes are added to it), or None when
    ``HERON_DISABLE_WEIGHT_CACHE`` is set."""
    if envs.is_set(envs.HERON_DISABLE_WEIGHT_CACHE):
        return None
    paths = [os.path.abspath(path) for path in sources]
    source = hashlib.sha256("|".join(paths).encode()).hexdigest()[:12]
    key = hashlib.sha256(version.encode())
    for path in paths:
        stat = os.stat(path)
        # the change time and inode too: a copy that keeps the modification time (cp -p, rsync -t, tar) with the
        # same size gave a new file the old one's entry
        key.update(f"|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}".encode())
    return os.path.join(envs.cache_dir("weights"), f"{source}-{key.hexdigest()[:16]}.{kind}.safetensors")


def save_entry(path: str, tensors: dict[str, torch.Tensor], sources: list[str],
               metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to the entry ``path`` (from ``entry_path``), then remove
    the entries it makes stale. A failed write is a warning, not an error."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    described = {**(metadata or {}), "sources": json.dumps([os.path.abspath(p) for p in sources])}
    partial = f"{path}.{os.getpid()}.partial"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, partial, metadata=described)
        os.replace(partial, path)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        logger.warning("could not write the weight cache entry %s: %s (the next start builds it again; "
                       "HERON_CACHE_DIR names another directory, HERON_DISABLE_WEIGHT_CACHE=1 skips the cache)",
                       path, exc)
        try:
            os.remove(partial)  # up to 0.5 GB of a file no one will read
        except OSError:
            pass
        return
    prune(path)


def prune(kept: str) -> None:
    """Remove the entries beside ``kept`` that no start is likely to read."""
    directory, name = os.path.split(kept)
    match = _ENTRY.match(name)
    assert match is not None, name
    stale, versions = [], []
    for other in os.listdir(directory):
        if _abandoned(os.path.join(directory, other)):
            stale.append(other)
            continue
        if other == name or not other.endswith(".safetensors"):
            continue
        found = _ENTRY.match(other)
        if found is None or not _sources_exist(os.path.join(directory, other)):  # the old naming; checkpoint gone
            stale.append(other)
        elif found.group(1) == match.group(1) and found.group(3) == match.group(3):  # another version
            versions.append(other)
    versions.sort(key=lambda other: _modified(os.path.join(directory, other)))
    for other in stale + versions[:-1]:  # all but the newest other version
        try:
            os.remove(os.path.join(directory, other))
            logger.info("removed the stale weight cache entry %s", other)
        except OSError:
            pass  # another process removed it first, or cannot: left for the next write


def _abandoned(path: str) -> bool:
    """A partial file left by a writer that died."""
    found = _PARTIAL.search(path)
    if found is None:
        return False
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return False
    return age >= ABANDONED_AFTER_S and not _process_alive(int(found.group(1)))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _modified(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _sources_exist(path: str) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as entry:
            sources = json.loads((entry.metadata() or {})["sources"])
    except Exception:  # unreadable (being written, damaged): keep it, a reader decides
        return True
    return all(os.path.exists(source) for source in sources)
