"""The disk KV tier's pieces without a model: the block file format (whole
files only, checked on read), the directory scan, and the index (write-through
a step late, discovery of other replicas' files, LRU bound with pins)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import threading
import time

import pytest

from heron.core import kv_disk_index, kv_disk_probe
from heron.core.kv_disk_index import DiskIndex
from heron.core.kv_disk_layout import HEADER_BYTES, STALE_TMP_SECONDS, CorruptBlockFile, DiskTierLayout

PAYLOAD = 64


def block_hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def write(layout: DiskTierLayout, i: int) -> None:
    payload = bytes([i % 256]) * PAYLOAD
    path = layout.path_for(block_hash(i))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(layout.header(block_hash(i), payload) + payload)


@pytest.fixture
def layout(tmp_path) -> DiskTierLayout:
    return DiskTierLayout.create(tmp_path, b"f" * 16, PAYLOAD)


def test_a_block_file_reads_back_only_whole_and_intact(layout):
    write(layout, 1)
    data = layout.path_for(block_hash(1)).read_bytes()
    assert bytes(layout.check(block_hash(1), data)) == bytes([1]) * PAYLOAD
    with pytest.raises(CorruptBlockFile):
        layout.check(block_hash(2), data)  # another block's file
    with pytest.raises(CorruptBlockFile):
        layout.check(block_hash(1), data[:-1])  # torn
    flipped = bytearray(data)
    flipped[HEADER_BYTES] ^= 1
    with pytest.raises(CorruptBlockFile, match="checksum"):
        layout.check(block_hash(1), bytes(flipped))
    other_model = DiskTierLayout(layout.root, b"g" * 16, PAYLOAD)
    with pytest.raises(CorruptBlockFile):
        other_model.check(block_hash(1), data)


def test_the_scan_finds_blocks_oldest_first_and_clears_dead_writers_files(layout):
    for i in (3, 1, 2):
        write(layout, i)
        os.utime(layout.path_for(block_hash(i)), (time.time() - 100 + i, time.time() - 100 + i))
    shard = layout.path_for(block_hash(1)).parent
    stale, fresh = shard / "a.kv.123.tmp", shard / "b.kv.456.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    old = time.time() - STALE_TMP_SECONDS - 10
    os.utime(stale, (old, old))
    (shard / "short.kv").write_bytes(b"x")  # the wrong size: not a block
    assert layout.scan() == [block_hash(1), block_hash(2), block_hash(3)]
    assert not stale.exists() and fresh.exists()  # a live writer's file is left alone


def test_writes_go_out_a_step_after_the_step_that_computes_them(layout):
    index = DiskIndex(layout, 10 * layout.file_bytes)
    index.write_through(5, block_hash(1))
    assert index.holds(block_hash(1))  # counted held from the moment it is queued
    assert index.take_ops().writes == []  # the step that computes block 5 runs first
    index.write_through(6, block_hash(2))
    index.write_through(7, block_hash(1))  # held already: no second write
    assert index.take_ops().writes == [(5, block_hash(1))]
    assert index.take_ops(idle=True).writes == [(6, block_hash(2))]  # no step coming: now


def test_a_withdrawn_block_is_never_written(layout):
    index = DiskIndex(layout, 10 * layout.file_bytes)
    index.write_through(5, block_hash(1))
    index.forget_unwritten(block_hash(1))
    assert not index.holds(block_hash(1)) and index.take_ops(idle=True).writes == []


def test_other_replicas_blocks_are_found_on_disk(layout):
    index = DiskIndex(layout, 10 * layout.file_bytes)
    assert index.lookup([block_hash(4)]) is False
    write(layout, 4)  # another engine sharing the directory
    assert not index.holds(block_hash(4)) and index.lookup([block_hash(4)]) is True and index.holds(block_hash(4))


def answered(index: DiskIndex) -> None:
    """Until the background lookups are done."""
    deadline = time.monotonic() + 10
    while index.is_probing and time.monotonic() < deadline:
        index.wait_for_probe(0.1)
        index.take_probe_answers()
    assert not index.is_probing


def test_lookups_past_the_steps_budget_go_on_in_the_background(layout, monkeypatch):
    """A slow file system (every stat past the budget): the lookup answers "not
    known yet" and the prober checks the run in order up to its first missing
    block; the answers are then known without asking the file system again."""
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0)
    index = DiskIndex(layout, 10 * layout.file_bytes)
    for i in (1, 2, 4):  # another replica's blocks; 3 is missing
        write(layout, i)
    run = [block_hash(i) for i in (1, 2, 3, 4)]
    assert index.lookup(run) is None and index.is_probing
    assert index.lookup(run) is None  # asked once: not again
    answered(index)
    stats = []
    monkeypatch.setattr(pathlib.Path, "is_file", lambda path: stats.append(path) or False)
    assert [index.lookup(run[i:]) for i in range(3)] == [True, True, False]
    assert stats == [] and not index.holds(block_hash(4))  # past the first missing block: never asked
    assert index.lookup(run[3:]) is None  # asked now


def test_a_step_asks_the_file_system_itself_within_its_budget(layout, monkeypatch):
    index = DiskIndex(layout, 10 * layout.file_bytes)
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0005)
    monkeypatch.setattr(kv_disk_index, "timed_is_file", lambda layout_, h: (h == block_hash(1), 0.0003))
    assert index.lookup([block_hash(1)]) is True  # 0.3 ms of a 0.5 ms budget spent
    assert index.lookup([block_hash(2)]) is False  # 0.6 ms spent: the budget is gone
    assert index.lookup([block_hash(3)]) is None
    index.take_ops()  # the next step: a new budget
    answered(index)
    assert index.lookup([block_hash(5)]) is False


def test_the_bound_evicts_least_recently_used_unpinned_blocks(layout):
    for i in range(3):
        write(layout, i)
    dropped = []
    index = DiskIndex(layout, 3 * layout.file_bytes, on_drop=dropped.append)
    assert len(index) == 3
    index.load("r", [(block_hash(0), 9)])  # pinned while being read, and used most recently
    index.write_through(1, block_hash(10))
    assert dropped == [block_hash(1)]
    index.write_through(2, block_hash(11))
    assert dropped == [block_hash(1), block_hash(2)]
    ops = index.take_ops()
    assert ops.deletes == [block_hash(1), block_hash(2)] and [load.request_id for load in ops.loads] == ["r"]
    index.write_through(3, block_hash(12))  # block 0 is pinned: the newest unwritten one goes instead
    assert dropped[-1] == block_hash(10)
    index.finish_load([block_hash(0)], failed=[block_hash(0)], num_used=0)
    assert not index.holds(block_hash(0)) and index.stats.load_failures == 1


def test_a_directory_that_cannot_be_made_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="--kv-offloading-dir .*cannot create"):
        DiskTierLayout.create(blocker / "tier", b"f" * 16, PAYLOAD)


def test_a_tier_too_small_for_one_block_is_refused(layout):
    with pytest.raises(ValueError, match="holds no block"):
        DiskIndex(layout, layout.file_bytes - 1)


def test_a_lookup_with_no_answer_in_time_is_a_miss_and_close_does_not_wait(layout, monkeypatch):
    """A hung file server: the prober's stat never returns. The lookup is a miss
    once LOOKUP_TIMEOUT_S has passed (the request recomputes), and closing the
    index returns at once."""
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0)
    monkeypatch.setattr(kv_disk_probe, "LOOKUP_TIMEOUT_S", 0.2)
    hung = threading.Event()
    monkeypatch.setattr(pathlib.Path, "is_file", lambda path: hung.wait(30))
    index = DiskIndex(layout, 10 * layout.file_bytes)
    assert index.lookup([block_hash(1)]) is None
    time.sleep(0.3)
    assert index.lookup([block_hash(1)]) is False
    started = time.monotonic()
    index.close()
    assert time.monotonic() - started < 0.5
    hung.set()


def test_a_block_deleted_since_it_was_asked_about_stays_missing(layout, monkeypatch):
    """Asked about in the background, the block is then computed here, written,
    and evicted (its file's deletion queued for the worker) before the answer,
    "present", is taken in: the answer is older than the deletion, so the block
    stays missing rather than coming back with no file behind it."""
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0)
    index = DiskIndex(layout, 1 * layout.file_bytes)
    write(layout, 1)  # another replica's file
    assert index.lookup([block_hash(1)]) is None
    index.write_through(5, block_hash(1))
    index.take_ops()
    assert index.take_ops().writes == [(5, block_hash(1))]
    index.write_through(6, block_hash(2))  # a tier of one block: block 1 gives way
    assert index.take_ops().deletes == [block_hash(1)]
    answered(index)
    assert not index.holds(block_hash(1)) and index.lookup([block_hash(1)]) is False


def test_a_run_longer_than_a_full_tier_loads_what_is_left(layout):
    """A full tier (one block) finds a prompt's first block held and its second
    on disk (another replica's): taking the second in evicts the first. Loading
    both must not fail the step; the evicted block's file is deleted first, so
    its read fails and the load-failure policy recomputes from there."""
    write(layout, 0)
    index = DiskIndex(layout, 1 * layout.file_bytes)
    write(layout, 1)
    run = [block_hash(0), block_hash(1)]
    assert index.lookup(run) is True and index.lookup(run[1:]) is True
    index.load("r", [(block_hash(0), 3), (block_hash(1), 4)])
    ops = index.take_ops()
    assert ops.deletes == [block_hash(0)] and [load.blocks for load in ops.loads] == [[(block_hash(0), 3),
                                                                                       (block_hash(1), 4)]]
    index.finish_load(run, failed=[block_hash(0)], num_used=0)
    assert index.holds(block_hash(1)) and not index.holds(block_hash(0))


def test_a_long_run_is_looked_up_in_pieces_at_once(layout, monkeypatch):
    """40 blocks on disk and a 41st missing: asked in pieces (several threads),
    every answer comes and the walk finds exactly the 40."""
    monkeypatch.setattr(kv_disk_index, "INLINE_LOOKUP_BUDGET_S", 0.0)
    index = DiskIndex(layout, 100 * layout.file_bytes)
    for i in range(40):
        write(layout, i)
    run = [block_hash(i) for i in range(41)]
    assert index.lookup(run) is None
    answered(index)
    assert [index.lookup(run[i:]) for i in range(41)] == [True] * 40 + [False]
