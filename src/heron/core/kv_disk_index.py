"""The scheduler's half of the disk KV tier: which blocks the tier directory
holds (``core/kv_disk_layout.py``), which writes, deletes and loads the worker
must make, and the tier's bound.

The disk tier is written through: a block is queued for writing in the step
after the one that computed it (its K/V is complete then, and is read before
the next forward pass could reuse the block), so a prefix is on disk while it
is still in the pool, survives a restart, and other replicas that share the
directory find it at once. Loads are asynchronous: a request whose prefix
continues on disk waits in its own state while the worker reads the files;
the blocks being read are pinned (LRU eviction skips them) until the worker
reports the load finished or failed.

The index starts from a scan of the directory. A lookup that misses it asks
the file system (one ``stat``), so blocks written by other replicas are found:
inline while the step has file-system time left in its budget
(``INLINE_LOOKUP_BUDGET_S``), else in the background (``core/kv_disk_probe.py``),
the lookup answering "not known yet" and the request waiting its turn without
holding others up. Blocks deleted by other replicas are found missing when
loaded, which the load-failure policy handles. Each replica bounds what it
knows of; replicas sharing a directory each keep within their own bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from heron.core.hashing import BlockHash
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.kv_disk_probe import MISSING_TTL_S, DiskProbe, timed_is_file

logger = logging.getLogger(__name__)

# file-system time a step may spend on lookups before the rest go to the prober:
# a local disk answers a 2,000-token prompt's every lookup within it (about
# 2 ms for 123 blocks another replica wrote), a network file system a few
# (BENCHMARKS.md, "A disk tier on a network file system")
INLINE_LOOKUP_BUDGET_S = 0.002


@dataclass(slots=True)
class DiskLoad:
    """One request's blocks to read, in prefix order: (block hash, pool block id)."""

    request_id: str
    blocks: list[tuple[BlockHash, int]]


@dataclass(slots=True)
class DiskOps:
    """What the worker does with the tier directory this step, in this order:
    capture and write ``writes`` (pool block id, hash), delete ``deletes``, then
    start ``loads`` in the background."""

    writes: list[tuple[int, BlockHash]] = field(default_factory=list)
    deletes: list[BlockHash] = field(default_factory=list)
    loads: list[DiskLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.writes or self.deletes or self.loads)


@dataclass(slots=True)
class DiskTierStats:
    """Cumulative: blocks written, loaded, evicted and failed to load; prompt tokens found."""

    stored: int = 0
    loaded: int = 0
    evicted: int = 0
    hit_tokens: int = 0
    load_failures: int = 0


class DiskIndex:
    def __init__(self, layout: DiskTierLayout, max_bytes: int,
                 on_drop: Callable[[BlockHash], None] | None = None) -> None:
        """``on_drop(block_hash)``: told when the tier deletes a block for room."""
        self.layout = layout
        self.capacity = max_bytes // layout.file_bytes
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_dir_size {max_bytes} bytes holds no block file of "
                             f"{layout.file_bytes} bytes")
        found = layout.scan()  # least recently written first
        _warn_of_other_layouts(layout)
        self._held: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(found[-self.capacity:])
        self._pins: dict[BlockHash, int] = {}
        # (pool block id, hash) registered while the step being scheduled is planned
        # (it computes them), then while the step before was (complete now)
        self._next_writes: list[tuple[int, BlockHash]] = []
        self._ready_writes: list[tuple[int, BlockHash]] = []
        # files past the bound (left by a run with a larger one, or by replicas sharing the directory: each start
        # added its bound's worth) are deleted by the first step's ops, oldest first
        self._ops = DiskOps(deletes=found[: max(0, len(found) - self.capacity)])
        self.stats = DiskTierStats()
        self.on_drop = on_drop
        self._probe = DiskProbe(layout)
        self._missing: dict[BlockHash, float] = {}  # block hash -> when the file system said it had none
        self._lookup_seconds = 0.0  # file-system time spent on lookups in the step being scheduled

    def __len__(self) -> int:
        return len(self._held)

    def lookup(self, run: Sequence[BlockHash]) -> bool | None:
        """Whether the tier holds ``run[0]`` (the rest of ``run``: the blocks after
        it in the prompt): known here, or found on disk (written by another
        replica, or before this index was built). None: not known yet, the file
        system is being asked in the background; ask again in a later step."""
        self.take_probe_answers()
        block_hash = run[0]
        if block_hash in self._held:
            self._held.move_to_end(block_hash)  # found now: the last to give way while the rest is looked up
            return True
        now = time.monotonic()
        missing_since = self._missing.get(block_hash)
        if missing_since is not None and now - missing_since < MISSING_TTL_S:
            return False
        if block_hash in self._probe.pending:
            return False if self._probe.timed_out(block_hash, now) else None
        if self._lookup_seconds >= INLINE_LOOKUP_BUDGET_S:
            self._probe.ask(run)
            return None
        present, seconds = timed_is_file(self.layout, block_hash)
        self._lookup_seconds += seconds
        if present:  # a miss is not remembered: asked again next time, the file may come
            self._learn_present(block_hash)
        return present

    @property
    def is_probing(self) -> bool:
        """Lookups are under way in the background (or answered, not taken in yet)."""
        return bool(self._probe.pending)

    def wait_for_probe(self, timeout: float) -> None:
        """Until an answer is there to take in (at once if one is)."""
        self._probe.wait(timeout)

    def close(self) -> None:
        self._probe.close()

    def take_probe_answers(self) -> None:
        """Take in what the background lookups found. A block this index deleted
        after it was asked about is still missing, whatever the stat saw (the
        worker deletes the file a step later)."""
        for block_hash, present, asked in self._probe.take_answers():
            if present:
                if self._missing.get(block_hash, -1.0) < asked:
                    self._learn_present(block_hash)
            elif present is not None:
                self._note_missing(block_hash)

    def _learn_present(self, block_hash: BlockHash) -> None:
        self._missing.pop(block_hash, None)
        if block_hash not in self._held:
            self._add(block_hash)

    def _note_missing(self, block_hash: BlockHash) -> None:
        now = time.monotonic()
        if len(self._missing) >= 4096:  # forget the stale answers before keeping more
            self._missing = {known: since for known, since in self._missing.items() if now - since < MISSING_TTL_S}
        self._missing[block_hash] = now

    def holds(self, block_hash: BlockHash) -> bool:
        """Known here (no file-system lookup)."""
        return block_hash in self._held

    def write_through(self, block_id: int, block_hash: BlockHash) -> None:
        """Pool block ``block_id`` is registered under ``block_hash`` and computed by
        the step now being scheduled: write it out at the start of the next one."""
        if block_hash in self._held:
            self._held.move_to_end(block_hash)
            return
        self._missing.pop(block_hash, None)
        self._next_writes.append((block_id, block_hash))
        self._add(block_hash)
        self.stats.stored += 1

    def forget_unwritten(self, block_hash: BlockHash) -> None:
        """A block registered during this step's planning will not be computed:
        drop its write (a block the tier held before keeps its file)."""
        for i, (_, pending_hash) in enumerate(self._next_writes):
            if pending_hash == block_hash:
                del self._next_writes[i]
                del self._held[block_hash]
                self.stats.stored -= 1
                return

    def forget_failed_writes(self, blocks: Iterable[BlockHash]) -> None:
        """Blocks whose write failed (a full or read-only disk): no longer held,
        nor counted stored (``on_drop`` told of each, for the KV events). One a
        load has pinned stays until that load fails on it (``finish_load``)."""
        for block_hash in blocks:
            if block_hash in self._held and block_hash not in self._pins:
                del self._held[block_hash]
                self.stats.stored -= 1
                if self.on_drop is not None:
                    self.on_drop(block_hash)

    def load(self, request_id: str, blocks: list[tuple[BlockHash, int]]) -> None:
        """Read these blocks into the pool in the background; pinned until ``finish_load``."""
        for block_hash, _ in blocks:
            self._pins[block_hash] = self._pins.get(block_hash, 0) + 1
            if block_hash in self._held:  # else given way to a block found after it: its read fails
                self._held.move_to_end(block_hash)
        self._ops.loads.append(DiskLoad(request_id, blocks))

    def finish_load(self, blocks: Sequence[BlockHash], failed: Iterable[BlockHash], num_used: int) -> None:
        """The worker is done with a load: unpin its blocks and forget the failed
        ones (``on_drop`` told of each, so that KV events report it removed where
        no one else holds it: the loader has deleted its file, or another replica
        had). ``num_used``: the blocks read that the request keeps (those before
        the first failure; the rest are computed again, so not counted loaded)."""
        for block_hash in blocks:
            count = self._pins.pop(block_hash)
            if count > 1:
                self._pins[block_hash] = count - 1
        failed = set(failed)
        dropped = [block_hash for block_hash in failed if block_hash in self._held]
        for block_hash in dropped:
            del self._held[block_hash]
        for block_hash in dropped:
            if self.on_drop is not None:
                self.on_drop(block_hash)
        self.stats.load_failures += len(failed)
        self.stats.loaded += num_used

    def take_ops(self, idle: bool = False) -> DiskOps:
        """The worker's work for the step being emitted: the writes of the step
        before it (``idle``, no step is coming: every write, the last step's
        blocks are complete then), this step's deletes and loads."""
        ops, self._ops = self._ops, DiskOps()
        self._lookup_seconds = 0.0  # the next step's lookups start a new budget
        if idle:
            ops.writes = self._ready_writes + self._next_writes
            self._ready_writes = []
        else:
            ops.writes, self._ready_writes = self._ready_writes, self._next_writes
        self._next_writes = []
        return ops

    def clear(self) -> None:
        """Delete every block this replica knows of (a prefix-cache reset, when idle)."""
        for block_hash in self._held:
            if block_hash not in self._pins:
                self._ops.deletes.append(block_hash)
                self._note_missing(block_hash)
        self._held = OrderedDict((h, None) for h in self._held if h in self._pins)
        self._next_writes = []
        self._ready_writes = []

    def _drop_unwritten(self, block_hash: BlockHash) -> bool:
        """Forget a write not handed to the worker yet; whether there was one."""
        for writes in (self._next_writes, self._ready_writes):
            for i, (_, pending_hash) in enumerate(writes):
                if pending_hash == block_hash:
                    del writes[i]
                    return True
        return False

    def _add(self, block_hash: BlockHash) -> None:
        self._held[block_hash] = None
        while len(self._held) > self.capacity and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        for block_hash in self._held:
            if block_hash not in self._pins:
                del self._held[block_hash]
                if not self._drop_unwritten(block_hash):
                    self._ops.deletes.append(block_hash)
                    self._note_missing(block_hash)
                self.stats.evicted += 1
                if self.on_drop is not None:
                    self.on_drop(block_hash)
                return True
        return False


def _warn_of_other_layouts(layout: DiskTierLayout) -> None:
    """Say what other layouts (another model, dtype, block size, heron version)
    keep in the same directory: the bound is this layout's, and their files are
    no one's to delete here (a replica of that layout may be using them), so
    they stay until removed by hand."""
    others: list[tuple[str, int]] = []
    with contextlib.suppress(OSError), os.scandir(layout.root.parent) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.path != str(layout.root):
                others.append((entry.name, _tree_bytes(entry.path)))
    if others:
        total = sum(size for _, size in others)
        logger.warning("the disk KV tier's directory %s also holds %d other layouts' blocks (%.1f MiB: %s), "
                       "outside this server's --kv-offloading-dir-size; remove the ones no server uses",
                       layout.root.parent, len(others), total / (1 << 20),
                       ", ".join(f"{name[:12]} {size / (1 << 20):.1f} MiB" for name, size in others[:4]))


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total
