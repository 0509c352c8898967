"""Chained block hashes for prefix caching.

The hash of full block ``i`` covers the hash of block ``i-1``, the block's token
ids and any extra keys (the cache salt, on the first block only, so that
requests with different salts never share a prefix). Equal hashes therefore mean
equal prefixes. SHA-256 keeps collisions (and deliberate cache poisoning across
tenants) out of reach; it is hardware-accelerated on current CPUs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from heron.request import Request

BlockHash = bytes

# how a block hash is made, named for routers that compute a prompt's hashes
# themselves: SHA-256 over (parent hash or the root, token ids as little-endian
# int64, then each extra key as a little-endian uint64 length + UTF-8 bytes)
BLOCK_HASH_SCHEME = "sha256-chain-v1"

_ROOT_HASH: BlockHash = hashlib.sha256(b"heron-prefix-cache-v1").digest()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
) -> BlockHash:
    hasher = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        hasher.update(struct.pack("<Q", len(encoded)))
        hasher.update(encoded)
    return hasher.digest()


def salt_keys(cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys of a request's first block."""
    return (f"salt:{cache_salt}",) if cache_salt else ()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """Extend ``hashes`` (the chain over the first ``len(hashes)`` full blocks of
    ``token_ids``) to every full block of ``token_ids``; returns ``hashes``."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        index = len(hashes)
        start = index * block_size
        extra = salt_keys(cache_salt) if index == 0 else ()
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size], extra))
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids``: what an engine
    registers for them, computed anywhere (a router hashes prompts with it)."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens
    (draft tokens excluded) and return the list."""
    return extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, request.cache_salt)
