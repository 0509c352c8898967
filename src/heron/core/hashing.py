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


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens
    (draft tokens excluded) and return the list."""
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    token_ids = request.all_token_ids
    while len(hashes) < num_full_blocks:
        index = len(hashes)
        parent = hashes[-1] if hashes else None
        extra = (f"salt:{request.cache_salt}",) if index == 0 and request.cache_salt else ()
        start = index * block_size
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
    return hashes
