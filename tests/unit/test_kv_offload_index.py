"""The offload tier's index: LRU eviction that skips the slots this step loads
from, saves before loads in one step's transfers, and counts."""

import pytest

from heron.core.kv_offload import OffloadIndex


def test_saves_take_free_slots_then_the_least_recently_used():
    index = OffloadIndex(num_slots=2)
    index.save(block_id=5, block_hash=b"a")
    index.save(block_id=6, block_hash=b"b")
    index.save(block_id=9, block_hash=b"a")  # held already: only refreshed (now b is the oldest)
    index.save(block_id=7, block_hash=b"c")  # full: b goes
    assert b"b" not in index and b"a" in index and b"c" in index
    transfers = index.take_transfers()
    assert transfers.saves == [(5, 0), (6, 1), (7, 1)] and transfers.loads == []
    assert (index.stats.stored, index.stats.evicted) == (3, 1)
    assert not index.take_transfers()  # taken once


def test_slots_read_this_step_are_never_evicted_before_the_step_runs():
    index = OffloadIndex(num_slots=2)
    index.save(1, b"a")
    index.save(2, b"b")
    index.take_transfers()
    index.pin([b"a", b"b"])
    index.save(3, b"c")  # every slot is being read: the save is skipped, nothing is overwritten
    assert b"c" not in index and index.stats.evicted == 0
    index.load(b"a", 4)
    index.take_transfers()  # the step ran: unpinned
    index.save(3, b"c")  # loading a refreshed it: b is the least recently used
    assert b"a" in index and b"b" not in index and b"c" in index


def test_loads_come_after_the_steps_saves_and_clear_forgets_everything():
    index = OffloadIndex(num_slots=4)
    index.save(7, b"x")
    index.pin([b"x"])
    index.load(b"x", 3)  # the same step: the worker saves 7 -> slot 0 first, then loads slot 0 -> 3
    transfers = index.take_transfers()
    assert transfers.saves == [(7, 0)] and transfers.loads == [(0, 3)]
    assert index.stats.loaded == 1
    index.clear()
    assert len(index) == 0 and b"x" not in index
    with pytest.raises(ValueError):
        OffloadIndex(0)
