"""The scheduler's half of a KV offload tier: which prefix blocks a slower,
larger store holds beyond the block pool, and what the worker must copy
before a step runs.

When the pool hands out a cached block again (evicting its prefix), the block
is saved to the tier under the same chained block hash (write-back: only what
leaves the pool is written). When a waiting request's prefix misses the pool,
the lookup goes on in the tier; blocks found there are allocated fresh in the
pool and loaded into it instead of being recomputed, and then count as
computed like any prefix-cache hit.

KV-cache events describe what the engine can serve without recomputing: a
block saved to the tier is not reported removed when it leaves the pool, only
when the tier drops it (and the pool does not hold it again), so a router's
index of a replica covers its tier too.

Copies happen in the worker at the start of the step that needs them, saves
before loads (a block evicted and refilled in one step is saved first), so a
loaded block is in the pool before any layer reads it. Slots read by this
step's loads are pinned: the tier's LRU eviction skips them until the step's
transfers are handed to the worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from heron.core.hashing import BlockHash
from heron.core.kv_disk_index import DiskOps


@dataclass(slots=True)
class KVTransfers:
    """The copies the worker makes before a step's forward pass: the disk
    tier's captures first (``disk``; its loads start last, in the background),
    then the host tier's saves and loads, in this order."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (pool block id, tier slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, pool block id)
    disk: DiskOps = field(default_factory=DiskOps)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.disk)


@dataclass(slots=True)
class OffloadStats:
    """Cumulative: blocks stored, loaded and evicted; prompt tokens found in the tier."""

    stored: int = 0
    loaded: int = 0
    evicted: int = 0
    hit_tokens: int = 0


class OffloadIndex:
    """The tier's map from block hash to slot, least recently used first."""

    def __init__(self, num_slots: int, on_drop: Callable[[BlockHash], None] | None = None) -> None:
        """``on_drop(block_hash)``: told when the tier gives a block up for room."""
        if num_slots < 1:
            raise ValueError("a KV offload tier needs room for at least one block")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._pending = KVTransfers()
        self.stats = OffloadStats()
        self.on_drop = on_drop

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._slots)

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Keep these blocks' slots until this step's transfers are taken."""
        self._pinned.update(self._slots[block_hash] for block_hash in block_hashes)

    def save(self, block_id: int, block_hash: BlockHash) -> bool:
        """A cached pool block is about to be reused: keep its contents here.
        Whether the tier holds the block now (False only when every slot is
        pinned by this step's loads)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return True
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return False
        self._slots[block_hash] = slot
        self._pending.saves.append((block_id, slot))
        self.stats.stored += 1
        return True

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        """Copy a held block into pool block ``block_id`` before this step runs."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pinned.add(slot)
        self._pending.loads.append((slot, block_id))
        self.stats.loaded += 1

    def take_transfers(self) -> KVTransfers:
        """This step's copies (the worker makes them before its forward pass); unpins."""
        transfers, self._pending = self._pending, KVTransfers()
        self._pinned.clear()
        return transfers

    def clear(self) -> None:
        """Forget every block (a prefix-cache reset); refused while a step has
        transfers pending, which the caller rules out by resetting only when idle."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def _evict_one(self) -> int | None:
        for block_hash, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[block_hash]
                self.stats.evicted += 1
                if self.on_drop is not None:
                    self.on_drop(block_hash)
                return slot
        return None
