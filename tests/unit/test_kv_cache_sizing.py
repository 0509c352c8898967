"""How many blocks the KV pool gets: a named budget (bytes, or what the GPU
profile leaves) is used whole; the CPU's share-of-RAM default is capped at what
max_num_seqs requests could use at once; a pool that cannot hold one request is
refused. A CPU pool is zeroed, writable memory in 4 KiB pages. And the host
tier's copies on the CPU: runs of slots, round trips."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from heron.config import CacheConfig
from heron.core.kv_offload import KVTransfers
from heron.worker.kv_cache_sizing import determine_num_kv_blocks, zeroed
from heron.worker.kv_offload_store import HostKVStore, _runs

BLOCK_BYTES = 1 << 20
CPU = torch.device("cpu")


def blocks(cache: CacheConfig, gpu_budget: int | None = None, max_model_len: int = 256, max_num_seqs: int = 2) -> int:
    return determine_num_kv_blocks(cache, BLOCK_BYTES, CPU, max_model_len, max_num_seqs, gpu_budget)


def test_a_gpu_budget_is_used_whole():
    # 2 requests of 256 tokens need 32 blocks; the budget holds 3,000
    assert blocks(CacheConfig(), gpu_budget=3000 * BLOCK_BYTES + 5) == 3000


def test_named_bytes_are_used_whole():
    assert blocks(CacheConfig(kv_cache_memory_bytes=500 * BLOCK_BYTES)) == 500


def test_the_cpu_default_is_capped_at_what_the_running_requests_use():
    assert blocks(CacheConfig(kv_cache_memory_fraction=1.0)) == 2 * 256 // 16


def test_num_kv_blocks_wins_and_a_pool_too_small_is_refused():
    assert blocks(CacheConfig(num_kv_blocks=40, kv_cache_memory_bytes=1 << 40)) == 40
    with pytest.raises(ValueError, match="cannot hold one request"):
        blocks(CacheConfig(), gpu_budget=15 * BLOCK_BYTES)


def test_num_kv_blocks_too_small_is_refused_before_the_model_loads():
    """It was refused only in the engine core, after the weights had loaded
    (seconds to minutes of a model's load for a mistake in a flag)."""
    from heron.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"3 blocks of 16 tokens, from num_kv_blocks.*max_model_len=2048"):
        EngineArgs(device="cpu", num_kv_blocks=3, max_model_len=2048).create_engine_config()
    assert EngineArgs(device="cpu", num_kv_blocks=128, max_model_len=2048).create_engine_config().cache.num_kv_blocks


def test_max_num_seqs_whose_block_tables_outgrow_the_host_is_refused_before_the_model_loads():
    """It failed after the weights had loaded, with numpy's allocation error
    naming no option."""
    from heron.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"max_num_seqs=10000000000 with max_model_len=8192 needs 19073\.5 GiB of "
                                         r"block tables.*lower max_num_seqs"):
        EngineArgs(device="cpu", max_num_seqs=10**10, max_model_len=8192).create_engine_config()
    assert EngineArgs(device="cpu", max_num_seqs=4096, max_model_len=8192).create_engine_config()


def test_a_cpu_pool_is_zeroed_writable_memory_in_small_pages():
    cache = zeroed((2, 64, 16, 8, 64), torch.float16, CPU)  # 16 MiB, K then V
    assert cache.shape == (2, 64, 16, 8, 64) and cache.dtype == torch.float16 and not cache.any()
    gc.collect()  # the tensor alone holds its memory
    cache.fill_(1.5)  # every page touched
    cache[1, 63] = 0.25
    assert cache[0].eq(1.5).all() and cache[1, :63].eq(1.5).all() and cache[1, 63].eq(0.25).all()
    if sys.platform == "linux":  # no transparent huge pages, whatever the system's default
        start = cache.data_ptr()
        with open("/proc/self/smaps") as smaps:
            region = None
            for line in smaps:
                fields = line.split()
                if "-" in fields[0] and len(fields) >= 5:
                    low, high = (int(bound, 16) for bound in fields[0].split("-"))
                    region = low <= start < high
                elif region and fields[0] == "AnonHugePages:":
                    assert fields[1] == "0", line
                    break
            else:
                pytest.fail("the pool's mapping is not in /proc/self/smaps")
    assert zeroed((0, 4), torch.float32, CPU).shape == (0, 4)


def test_slots_group_into_runs():
    assert _runs([4, 5, 6, 9, 0, 1, 3]) == [(0, 4, 3), (3, 9, 1), (4, 0, 2), (6, 3, 1)]
    assert _runs([]) == []


def test_the_host_tier_round_trips_blocks_on_the_cpu():
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 6, 4, 2, 8, generator=generator).to(dtype) for dtype in (torch.float32, torch.float16)]
    originals = [cache.clone() for cache in caches]
    store = HostKVStore(caches, num_slots=5)
    store.apply(KVTransfers(saves=[(1, 3), (4, 4), (2, 0)]))
    for cache in caches:
        cache.zero_()
    store.apply(KVTransfers(loads=[(3, 5), (4, 0), (0, 2)]))
    for cache, original in zip(caches, originals):
        assert torch.equal(cache[:, 5], original[:, 1]) and torch.equal(cache[:, 0], original[:, 4])
        assert torch.equal(cache[:, 2], original[:, 2])
        assert not cache[:, [1, 3, 4]].any()


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_memory_limit_bounds_what_is_available(tmp_path, version):
    """The default pool was a share of the host's MemAvailable: in a 1.5 GiB
    container on a 23 GiB host it reserved 5.6 GiB, and the OOM killer ended the
    engine once requests filled it. The least room of the cgroup and its
    parents counts (a limit set on a parent slice binds too)."""
    from heron.worker.kv_cache_sizing import cgroup_memory_room

    files = ({"memory.max": "memory.max", "memory.current": "memory.current"} if version == 2 else
             {"memory.max": "memory.limit_in_bytes", "memory.current": "memory.usage_in_bytes"})
    mount = tmp_path / "cgroup" if version == 2 else tmp_path / "cgroup" / "memory"
    for directory, limit, usage in ((mount, "max" if version == 2 else str(2**63 - 4096), 10 << 30),
                                    (mount / "kubepods", 3 << 30, 2 << 30),  # 1 GiB left on the parent
                                    (mount / "kubepods" / "pod", 1536 << 20, 1 << 30)):  # 512 MiB here
        directory.mkdir(parents=True, exist_ok=True)
        (directory / files["memory.max"]).write_text(f"{limit}\n")
        (directory / files["memory.current"]).write_text(f"{usage}\n")
    stat_key = "inactive_file" if version == 2 else "total_inactive_file"
    # v1's own inactive_file comes first and counts none of the children's pages: the subtree's total counts
    own = "inactive_file 0\n" if version == 1 else ""
    (mount / "kubepods" / "pod" / "memory.stat").write_text(f"{own}active_file 5\n{stat_key} {256 << 20}\n")
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("0::/kubepods/pod\n" if version == 2 else "12:memory:/kubepods/pod\n3:cpu,cpuacct:/x\n")
    # 512 MiB here, with 256 MiB of inactive page cache that is reclaimed first
    assert cgroup_memory_room(str(proc), str(tmp_path / "cgroup")) == 768 << 20
    proc.write_text("0::/\n" if version == 2 else "12:memory:/\n")  # the root: no limit
    assert cgroup_memory_room(str(proc), str(tmp_path / "cgroup")) is None


def test_a_named_pool_larger_than_memory_is_refused_at_start(monkeypatch):
    """--kv-cache-memory-bytes 100GiB on a 23 GiB host started healthy (the pool
    is reserved untouched) and was killed once requests filled it."""
    from heron.worker import kv_cache_sizing

    monkeypatch.setattr(kv_cache_sizing, "available_memory_bytes", lambda device: 600 * BLOCK_BYTES)
    assert blocks(CacheConfig(kv_cache_memory_bytes=500 * BLOCK_BYTES)) == 500
    for cache, source in ((CacheConfig(kv_cache_memory_bytes=700 * BLOCK_BYTES), "kv_cache_memory_bytes="),
                          (CacheConfig(num_kv_blocks=700), "num_kv_blocks")):
        with pytest.raises(ValueError, match=f"from {source}.* is more than the memory available"):
            blocks(cache)
    assert blocks(CacheConfig(kv_cache_memory_fraction=1.0)) == 2 * 256 // 16  # the default takes its share
