"""The disk KV tier's pieces without a model: the block file format (whole
files only, checked on read), the directory scan, and the index (write-through
a step late, discovery of other replicas' files, LRU bound with pins)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

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
    assert block_hash(1) in index  # counted held from the moment it is queued
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
    assert block_hash(4) not in index
    write(layout, 4)  # another engine sharing the directory
    assert not index.holds(block_hash(4)) and block_hash(4) in index and index.holds(block_hash(4))


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
    index.finish_load([block_hash(0)], failed=[block_hash(0)])
    assert not index.holds(block_hash(0)) and index.stats.load_failures == 1


def test_a_tier_too_small_for_one_block_is_refused(layout):
    with pytest.raises(ValueError, match="holds no block"):
        DiskIndex(layout, layout.file_bytes - 1)
