"""Where and how the disk KV tier keeps blocks: one file per block, named by
its chained block hash, under a directory per model layout; what both halves
of the tier (``core/kv_disk_index.py``, ``worker/kv_disk_store.py``) agree on.

    <dir>/<layout fingerprint, 32 hex>/<first hash byte, 2 hex>/<block hash, 64 hex>.kv

A file is a fixed header (magic, layout fingerprint, block hash, payload
length, CRC-32 of the payload) and the block's K/V for every attention layer,
as the pool holds it. Files are written to a temporary name and renamed, so a
reader sees a whole file or none; a reader still checks the header and the
checksum (a torn write after a power loss, a file from another layout, a
flipped bit) and treats any mismatch as a miss.

The fingerprint covers what makes two engines' K/V interchangeable: the
model's config, a digest of all its weight bytes, the dtypes and the cache
layout. Engines that agree on it (restarts, replicas on other machines with
the same weights) share the directory; any other engine gets its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from heron.core.hashing import BLOCK_HASH_SCHEME, BlockHash
from heron.core.weight_digest import weights_digest

MAGIC = b"HERONKV1"
_HEADER = struct.Struct("<8s16s32sQI")
HEADER_BYTES = _HEADER.size
FILE_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
# temporary files older than this at start-up were left by a process that died mid-write
STALE_TMP_SECONDS = 300.0
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class CorruptBlockFile(Exception):
    """A block file that does not hold what its name promises."""


@dataclass(frozen=True)
class DiskTierLayout:
    """One model layout's directory in a disk tier."""

    root: Path  # <dir>/<fingerprint hex>
    fingerprint: bytes  # 16 bytes
    payload_bytes: int  # one block's K/V over every layer

    @classmethod
    def create(cls, directory: str | os.PathLike[str], fingerprint: bytes, payload_bytes: int) -> DiskTierLayout:
        root = Path(directory) / fingerprint.hex()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a user's path: say which option, not a traceback
            raise ValueError(f"--kv-offloading-dir {directory}: cannot create {root}: {exc.strerror or exc}") from exc
        return cls(root, fingerprint, payload_bytes)

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def path_for(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + FILE_SUFFIX)

    def header(self, block_hash: BlockHash, payload: bytes | memoryview) -> bytes:
        return _HEADER.pack(MAGIC, self.fingerprint, block_hash, len(payload), zlib.crc32(payload))

    def check(self, block_hash: BlockHash, data: bytes | memoryview) -> memoryview:
        """The payload of a whole file's bytes; CorruptBlockFile if the file is not
        this layout's block ``block_hash``, whole and intact."""
        if len(data) != self.file_bytes:
            raise CorruptBlockFile(f"{len(data)} bytes, expected {self.file_bytes}")
        payload = memoryview(data)[HEADER_BYTES:]
        self.check_parts(block_hash, memoryview(data)[:HEADER_BYTES], payload)
        return payload

    def check_parts(self, block_hash: BlockHash, header: bytes | memoryview, payload: bytes | memoryview) -> None:
        """``check`` for a file read as its header and its payload (into a buffer of
        the reader's): CorruptBlockFile unless they are whole and intact."""
        if len(header) != HEADER_BYTES:
            raise CorruptBlockFile(f"a header of {len(header)} bytes")
        magic, fingerprint, stored_hash, length, crc = _HEADER.unpack_from(header)
        if magic != MAGIC or fingerprint != self.fingerprint or stored_hash != block_hash:
            raise CorruptBlockFile("header names another layout or block")
        if length != len(payload) or length != self.payload_bytes or zlib.crc32(payload) != crc:
            raise CorruptBlockFile("checksum mismatch")

    def scan(self) -> list[BlockHash]:
        """The blocks on disk now, least recently written first; temporary files
        left by a writer that died long ago are removed."""
        found: list[tuple[float, BlockHash]] = []
        stale_before = time.time() - STALE_TMP_SECONDS
        for entry in _walk(self.root):
            name = entry.name
            try:
                if name.endswith(TMP_SUFFIX):
                    if entry.stat().st_mtime < stale_before:
                        os.unlink(entry.path)
                    continue
                if not name.endswith(FILE_SUFFIX) or entry.stat().st_size != self.file_bytes:
                    continue
                found.append((entry.stat().st_mtime, bytes.fromhex(name[: -len(FILE_SUFFIX)])))
            except (OSError, ValueError):
                continue  # removed meanwhile by another replica, or not one of ours
        found.sort()
        return [block_hash for _, block_hash in found]


def _walk(root: Path) -> Iterator[os.DirEntry[str]]:
    with os.scandir(root) as shards:
        for shard in shards:
            if shard.is_dir():
                with os.scandir(shard.path) as entries:
                    yield from entries


def layout_fingerprint(model_path: str, hf_config: object, cache_layout: Iterable[object]) -> bytes:
    """16 bytes naming a model's K/V layout: its config, a digest of each
    weight file's whole contents (``core/weight_digest.py``), and
    ``cache_layout`` (dtypes and per-block shapes of every layer's cache,
    block size, quantization...)."""
    digest = hashlib.blake2b(digest_size=16)
    to_json = getattr(hf_config, "to_json_string", None)
    config_text = to_json(use_diff=False) if callable(to_json) else repr(hf_config)
    digest.update(json.dumps([BLOCK_HASH_SCHEME, config_text, [repr(x) for x in cache_layout]]).encode())
    for path in _weight_files(model_path):
        digest.update(f"{path.name}:{path.stat().st_size}:".encode() + weights_digest(str(path)))
    return digest.digest()


def _weight_files(model_path: str) -> list[Path]:
    path = Path(model_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
