"""Gateway state the API-server processes of one ``heron serve
--api-server-count M`` share, so its limits hold for the server as a whole and
not per process: the per-key token buckets of ``--rate-limit`` and the count of
waiting requests behind ``--max-waiting-requests``; and whether each API server
can serve (``server.py`` starts listening on the others only once they and the
first can).

It lives in one file mapped into every process (no extra server process):

* a waiting-request count per API server, each written only by its owner and
  summed by whoever checks the bound; a check and the admission it allows
  happen under an exclusive ``flock`` of the file;
* a ready flag per API server, written once by its owner;
* a fixed table of token buckets, keyed by a digest of the key (API key or
  client address), changed under the same lock. A key's
  slot is found by linear probing; when its probe window is full, the bucket
  used longest ago gives way (it has refilled the most, so a client it belonged
  to loses the least).

``time.monotonic`` is one clock for every process on a host, so buckets
refill the same wherever they are read.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

_MAGIC = b"heronGW1"
_HEADER = struct.Struct("<8sqq")  # magic, number of API servers, number of bucket slots
_COUNT = struct.Struct("<q")
_BUCKET = struct.Struct("<16sdd")  # key digest, tokens, last refill time (0: empty slot)
_PROBES = 32
DEFAULT_BUCKET_SLOTS = 1 << 15


def create_shared_gateway_file(path: str, num_servers: int, bucket_slots: int = DEFAULT_BUCKET_SLOTS) -> None:
    """Write the zeroed state file (the launcher does this before starting the API servers)."""
    size = _HEADER.size + 2 * num_servers * _COUNT.size + bucket_slots * _BUCKET.size
    with open(path, "wb") as handle:
        handle.truncate(size)
        handle.write(_HEADER.pack(_MAGIC, num_servers, bucket_slots))


class SharedGatewayState:
    def __init__(self, path: str, server_index: int) -> None:
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, 0)
        magic, self.num_servers, self.bucket_slots = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC:
            raise ValueError(f"{path} is not a heron gateway state file")
        if not 0 <= server_index < self.num_servers:
            raise ValueError(f"API server index {server_index} outside 0..{self.num_servers - 1}")
        self.server_index = server_index
        self._counts_at = _HEADER.size
        self._ready_at = self._counts_at + self.num_servers * _COUNT.size
        self._buckets_at = self._ready_at + self.num_servers * _COUNT.size

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    # ---- waiting requests ------------------------------------------------------------------

    def publish_waiting(self, count: int) -> None:
        """This API server's waiting requests (an aligned 8-byte store: readers see old or new)."""
        _COUNT.pack_into(self._map, self._counts_at + self.server_index * _COUNT.size, count)

    def total_waiting(self) -> int:
        return sum(_COUNT.unpack_from(self._map, self._counts_at + index * _COUNT.size)[0]
                   for index in range(self.num_servers))

    @contextmanager
    def admitting(self) -> Iterator[int]:
        """The server-wide waiting count, with every other API server's admissions
        held off until the block ends. A request admitted inside the block and
        published (``publish_waiting``) before it ends is seen by the next check
        anywhere, so checks running at once cannot all pass on one free place."""
        with self._locked():
            yield self.total_waiting()

    # ---- readiness ------------------------------------------------------------------------

    def publish_ready(self) -> None:
        """This API server can serve (its engine client and tokenizer are ready)."""
        _COUNT.pack_into(self._map, self._ready_at + self.server_index * _COUNT.size, 1)

    def is_ready(self, server_index: int) -> bool:
        return _COUNT.unpack_from(self._map, self._ready_at + server_index * _COUNT.size)[0] == 1

    # ---- token buckets ---------------------------------------------------------------------

    def take_token(self, key: str, rate: float, burst: float, now: float) -> float:
        """Take one token from ``key``'s bucket (created full). Returns 0.0 when
        taken, else the seconds until one is available."""
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        with self._locked():
            offset = self._slot(digest)
            stored, tokens, updated = _BUCKET.unpack_from(self._map, offset)
            if stored != digest or updated == 0.0:
                tokens, updated = burst, now
            tokens = min(burst, tokens + max(0.0, now - updated) * rate)
            wait = 0.0
            if tokens < 1.0:
                wait = (1.0 - tokens) / rate
            else:
                tokens -= 1.0
            # a process that read its clock before waiting for the lock must not set the time back: the span
            # between would be refilled twice
            _BUCKET.pack_into(self._map, offset, digest, tokens, max(now, updated))
            return wait

    def _slot(self, digest: bytes) -> int:
        """The offset of ``digest``'s slot, or of the slot it should take."""
        start = int.from_bytes(digest[:8], "little") % self.bucket_slots
        oldest_offset, oldest_time = -1, float("inf")
        for probe in range(min(_PROBES, self.bucket_slots)):
            offset = self._buckets_at + ((start + probe) % self.bucket_slots) * _BUCKET.size
            stored, _, updated = _BUCKET.unpack_from(self._map, offset)
            if stored == digest or updated == 0.0:
                return offset
            if updated < oldest_time:
                oldest_offset, oldest_time = offset, updated
        return oldest_offset

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
