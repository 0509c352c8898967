"""The pool of fixed-size KV-cache blocks: reference counts, an LRU free queue, and
the prefix-cache map from block hash to block.

Invariants:

* a block is in the free queue exactly when its ``ref_cnt`` is 0;
* a free block may still hold a hash (its K/V is still valid and reusable); the
  hash is forgotten only when the block is handed out again (lazy eviction), so the
  free queue's order is the eviction order: the front is evicted first;
* ``cached_blocks[h] is b`` implies ``b.block_hash == h``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from heron.core.hashing import BlockHash
from heron.core.kv_events import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # links of the free queue; None when the block is not in it (or at an end)
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    in_free_queue: bool = False

    def __repr__(self) -> str:
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the front, append at the
    back, and removal from the middle (when a cached free block is reused)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise RuntimeError("no free KV-cache blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if not block.in_free_queue:
            raise RuntimeError(f"{block} is not in the free queue")
        if block.prev_free is not None:
            block.prev_free.next_free = block.next_free
        else:
            self._head = block.next_free
        if block.next_free is not None:
            block.next_free.prev_free = block.prev_free
        else:
            self._tail = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise RuntimeError(f"{block} is already in the free queue")
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is not None:
            self._tail.next_free = block
        else:
            self._head = block
        self._tail = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    """``events``, when given, records every change of the prefix-cache map
    (``cached_blocks``): a hash registered, a hash evicted, all cleared. Replaying
    them gives exactly the set of hashes the map holds."""

    def __init__(self, num_blocks: int, enable_caching: bool, events: KVEventRecorder | None = None,
                 on_evict: Callable[[int, BlockHash], bool] | None = None) -> None:
        """``on_evict(block_id, block_hash)``: told before a cached block's
        contents are given up; True when it keeps them (an offload tier saved
        them), so the block is not reported removed: the engine still holds it."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.events = events
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting any
        cached content they still hold; each comes back with ``ref_cnt == 1``."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of
        the free queue in the given order (the first given is evicted first)."""
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
    ) -> None:
        """Register blocks ``[num_cached_blocks, num_full_blocks)`` of a request in
        the prefix cache. If an equal block is already cached, the older one stays
        the canonical copy and this block is left unregistered. ``token_ids`` (the
        request's) and ``block_size`` describe the stored blocks to ``events``."""
        if not self.enable_caching:
            return
        stored: list[int] = []  # indexes newly registered as canonical
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already registered
            block_hash = block_hashes[index]
            block.block_hash = block_hash
            if self.cached_blocks.setdefault(block_hash, block) is block:
                stored.append(index)
        if self.events is not None and stored:
            self._record_stored(stored, block_hashes, token_ids, block_size)

    def _record_stored(
        self, indexes: list[int], block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int
    ) -> None:
        """One ``BlockStored`` per run of consecutive blocks (each run names its parent)."""
        assert self.events is not None
        # consecutive indexes share index - position
        for _, group in itertools.groupby(enumerate(indexes), key=lambda pair: pair[1] - pair[0]):
            run = [index for _, index in group]
            first, last = run[0], run[-1]
            self.events.stored(
                [block_hashes[i] for i in run],
                block_hashes[first - 1] if first > 0 else None,
                list(token_ids[first * block_size : (last + 1) * block_size]),
                block_size,
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.events is not None:
            self.events.cleared()
        return True

    def uncache(self, block: KVCacheBlock) -> BlockHash | None:
        """Take a block out of the prefix cache without saving it anywhere: its
        K/V was never computed (its request gave back the step that would have).
        Returns its hash if it was the cached copy."""
        block_hash = block.block_hash
        block.block_hash = None
        if block_hash is None or self.cached_blocks.get(block_hash) is not block:
            return None
        del self.cached_blocks[block_hash]
        return block_hash

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
            kept = self.on_evict(block.block_id, block_hash) if self.on_evict is not None else False
            if self.events is not None and not kept:
                self.events.removed(block_hash)
        block.block_hash = None

    def check_integrity(self, owned_blocks: Iterable[list[KVCacheBlock]]) -> None:
        """Raise AssertionError unless the pool's books balance: every block is
        either free (ref 0, in the queue) or owned, with ``ref_cnt`` equal to the
        number of owners, and the cache map points only at blocks with that hash."""
        owners = [0] * self.num_blocks
        for blocks in owned_blocks:
            for block in blocks:
                owners[block.block_id] += 1
        queued = [block.block_id for block in self.free_queue]
        assert len(queued) == len(set(queued)), "a block is in the free queue twice"
        assert len(queued) == self.num_free_blocks, "free-block count is wrong"
        queued_set = set(queued)
        for block in self.blocks:
            assert block.ref_cnt == owners[block.block_id], (
                f"{block} has ref_cnt {block.ref_cnt} but {owners[block.block_id]} owners"
            )
            assert (block.ref_cnt == 0) == (block.block_id in queued_set), (
                f"{block}: free-queue membership disagrees with its ref count"
            )
            assert block.in_free_queue == (block.block_id in queued_set)
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} is cached under a stale hash"
