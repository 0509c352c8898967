"""The digest of a weight file's whole contents, kept between starts.

What makes two engines' K/V interchangeable includes every weight: a digest of
samples (start, middle, end) gave a checkpoint that differed elsewhere (a
fine-tune of a few layers, new weights written over the old) the same name,
and a restarted server read the other model's K/V from the disk tier. Hashing
a large checkpoint takes seconds, so the digest is kept under
``~/.cache/heron/digests`` (``HERON_CACHE_DIR``), keyed by the file's path,
size, modification and change times and inode: a start after the first reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from heron import envs

logger = logging.getLogger(__name__)
_CHUNK_BYTES = 8 << 20
_ANNOUNCE_BYTES = 1 << 30  # a file this large is named in the log while it is hashed


def weights_digest(path: str) -> bytes:
    """16 bytes digesting the file at ``path`` (read whole once per version of the file)."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    version = f"{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
    record = os.path.join(envs.cache_dir("digests"), hashlib.sha256(path.encode()).hexdigest()[:24] + ".json")
    try:
        with open(record, encoding="utf-8") as file:
            kept = json.load(file)
        if kept.get("path") == path and kept.get("version") == version:
            return bytes.fromhex(kept["digest"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # none yet, or unreadable: computed again
    if stat.st_size >= _ANNOUNCE_BYTES:
        logger.info("hashing %s (%.1f GiB) for the KV layout fingerprint, once per version of the file", path,
                    stat.st_size / (1 << 30))
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    _keep(record, {"path": path, "version": version, "digest": digest.hexdigest()})
    return digest.digest()


def _keep(record: str, value: dict[str, str]) -> None:
    """Write the record atomically; a cache that cannot be written is no error."""
    partial = f"{record}.{os.getpid()}.partial"
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(value, file)
        os.replace(partial, record)
    except OSError as exc:
        logger.debug("could not keep the weight digest in %s: %s", record, exc)
