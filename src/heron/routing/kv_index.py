"""What one replica's prefix cache holds, rebuilt from its KV-cache events
(``core/kv_events.py``): never guessed from where the router sent requests.

Applying a replica's event batches in sequence order gives exactly the set of
block hashes its prefix-cache map holds. A batch that went missing and cannot
be replayed makes the index untrustworthy: it is then cleared (it under-counts
until the replica stores blocks again, which only costs affinity, never
correctness).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from heron.core.hashing import BlockHash
from heron.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

EXPECTATION_SECONDS = 30.0


@dataclass
class KVBlockIndex:
    """``blocks``: what the replica reported holding. ``expected``: blocks of
    requests just sent there, not reported yet (block -> when expected); they
    count as held until reported, removed or ``EXPECTATION_SECONDS`` old."""

    blocks: set[BlockHash] = field(default_factory=set)
    last_seq: int = -1  # sequence number of the last batch applied
    expected: dict[BlockHash, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def expect(self, block_hashes: Sequence[BlockHash]) -> None:
        now = self.clock()
        expected = self.expected
        for block_hash in block_hashes:
            if block_hash not in self.blocks:
                expected.pop(block_hash, None)  # re-inserted last: the dict stays in the order of expectation
                expected[block_hash] = now
        # those too old go from the front (blocks a replica never reported: events off, a failed request)
        while expected:
            oldest, since = next(iter(expected.items()))
            if now - since <= EXPECTATION_SECONDS:
                break
            del expected[oldest]

    def forget_expected(self, block_hashes: Sequence[BlockHash]) -> None:
        """The request that made these blocks expected never reached the replica."""
        for block_hash in block_hashes:
            self.expected.pop(block_hash, None)

    def _holds(self, block_hash: BlockHash) -> bool:
        if block_hash in self.blocks:
            return True
        since = self.expected.get(block_hash)
        if since is None:
            return False
        if self.clock() - since > EXPECTATION_SECONDS:
            del self.expected[block_hash]
            return False
        return True

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply batch ``seq``; batches at or before ``last_seq`` were applied already."""
        if seq <= self.last_seq:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
                for block_hash in event.block_hashes:
                    self.expected.pop(block_hash, None)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
                for block_hash in event.block_hashes:
                    self.expected.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                self.expected.clear()
        self.last_seq = seq

    def reset(self, last_seq: int = -1) -> None:
        """Forget everything (a replica died, or batches were lost for good)."""
        self.blocks.clear()
        self.expected.clear()
        self.last_seq = last_seq

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of a prompt's leading blocks this replica holds (a hole ends
        the run: attention needs every earlier block)."""
        count = 0
        for block_hash in block_hashes:
            if not self._holds(block_hash):
                break
            count += 1
        return count
