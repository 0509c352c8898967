"""How many KV-cache blocks to allocate, from the configured budget, and the
allocation of a model's per-layer caches."""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from heron.config import CacheConfig, check_pool_holds_one_request
from heron.utils import cdiv

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def layers_bytes_per_block(layers: list[Any], block_size: int, dtype: torch.dtype) -> int:
    """``kv_cache_bytes_per_block`` of a model's attention layers."""
    spec = layers[0].spec
    return kv_cache_bytes_per_block(
        num_layers=len(layers),
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=dtype,
    )


def bind_kv_caches(
    layers: list[Any], backend: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Give every attention layer a zeroed cache of ``num_blocks`` blocks (stale
    NaNs in padded slots would leak through a masked softmax as 0 * NaN) and the
    backend that reads it; returns the caches."""
    caches = []
    for layer in layers:
        spec = layer.spec
        cache = zeroed(backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim), dtype, device)
        layer.kv_cache = cache
        layer.backend = backend
        caches.append(cache)
    return caches


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed memory. On CPU, private anonymous memory in 4 KiB pages, which the
    kernel zero-fills on first touch, so a multi-GiB cache costs nothing until it
    is used. Not transparent huge pages (numpy asks for them for large arrays):
    a huge page's first touch lands on a request's path and zeroes 2 MiB at once
    (with compaction, where memory is fragmented). On a 2-core Zen 3 VM, a
    306-token prefill over never-used blocks spent 29-31 ms of system time in
    those faults against 7.5-8 ms with 4 KiB pages (BENCHMARKS.md, "The KV
    pool's first touch"); over blocks used before, both take 1-2 ms."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element_size = torch.empty((), dtype=dtype).element_size()
    size = int(np.prod(shape)) * element_size
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        region.madvise(mmap.MADV_NOHUGEPAGE)
    # the array (and the tensor viewing it) holds the mapping open
    return torch.from_numpy(np.frombuffer(region, dtype=np.uint8)).view(dtype).view(shape)


def available_memory_bytes(device: torch.device) -> int:
    """Memory the KV cache may draw from: free device memory on CUDA; on CPU the
    kernel's MemAvailable estimate, or less where the process's cgroup (a
    container's memory limit) leaves less: a pool sized from the host's memory
    filled up while serving and the OOM killer ended the engine."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = 4 << 30  # no /proc (not Linux): assume a modest 4 GiB
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    room = cgroup_memory_room()
    return available if room is None else min(available, room)


# a cgroup limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page)
_NO_LIMIT = 1 << 60


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """What the memory limits of this process's cgroup and its ancestors leave
    (limit minus usage, the least of them), or None where none is set.
    cgroup v2 (``memory.max``, ``memory.current``) or v1's memory controller
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            return _least_room(root, path, "memory.max", "memory.current")
        if "memory" in controllers.split(","):
            return _least_room(os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes")
    return None


def _least_room(mount: str, path: str, limit_file: str, usage_file: str) -> int | None:
    """The least limit-minus-usage from ``mount/path`` up to ``mount`` (a path
    the namespace hides reads as the mount itself)."""
    rooms = []
    parts = [part for part in path.strip("/").split("/") if part]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(mount, *parts[:depth])
        limit, usage = _read_int(os.path.join(directory, limit_file)), _read_int(os.path.join(directory, usage_file))
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            # usage counts the page cache; its inactive part is reclaimed before anything is killed
            # (Kubernetes' "working set" is the same difference)
            rooms.append(max(limit - usage + _inactive_file_bytes(directory), 0))
    return min(rooms) if rooms else None


def _inactive_file_bytes(directory: str) -> int:
    """The inactive page cache of a cgroup and its children: v1's
    ``total_inactive_file`` (its ``inactive_file`` is the cgroup's own pages
    alone, while usage counts the subtree), else v2's ``inactive_file``; 0 if unread."""
    stats: dict[str, int] = {}
    try:
        with open(os.path.join(directory, "memory.stat"), encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    stats[key] = int(value)
    except OSError:
        pass
    return stats.get("total_inactive_file", stats.get("inactive_file", 0))


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


_GIB = float(1 << 30)
# left free on the GPU for CUDA-graph pools, cuBLAS workspaces and fragmentation
_GPU_HEADROOM_BYTES = 512 << 20


def gpu_kv_cache_budget(total_memory_fraction: float, profile_peak: Callable[[], int], device: torch.device) -> int:
    """Bytes the KV cache may take on a GPU: ``total * fraction`` minus the weights
    (allocated now), the activation peak of a profiled worst-case step, memory used
    outside torch (CUDA context, other processes) and a fixed headroom."""
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    peak = profile_peak()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(total * total_memory_fraction) - weights - peak - outside_torch - _GPU_HEADROOM_BYTES
    logger.info(
        "GPU memory: %.1f GiB total x %.2f; weights %.2f GiB, activation peak %.2f GiB, "
        "outside torch %.2f GiB -> KV cache %.2f GiB",
        total / _GIB, total_memory_fraction, weights / _GIB, peak / _GIB, outside_torch / _GIB, max(budget, 0) / _GIB,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={total_memory_fraction}; "
            "raise it, or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget


def determine_num_kv_blocks(
    cache_config: CacheConfig,
    bytes_per_block: int,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    gpu_budget_bytes: int | None = None,
) -> int:
    """Blocks for the configured budget: ``num_kv_blocks`` if given, else
    ``kv_cache_memory_bytes``, else (GPU) all of the profiled budget, else (CPU) a
    fraction of available memory capped at what ``max_num_seqs`` requests of
    ``max_model_len`` tokens could use at once.

    A budget the user or the GPU profile names is used whole: blocks past what the
    running requests need keep finished prefixes in the prefix cache, the fastest
    tier there is, so a slower offload tier only pays once the pool is full. Only
    the CPU's default (a guess at a share of RAM that other processes also want)
    is capped. Fails with a clear message when the pool could not hold even one
    full-length request."""
    block_size = cache_config.block_size
    blocks_per_seq = cdiv(max_model_len, block_size)
    if cache_config.num_kv_blocks is not None:
        num_blocks = cache_config.num_kv_blocks
        budget_source = "num_kv_blocks"
    else:
        if cache_config.kv_cache_memory_bytes is not None:
            num_blocks = cache_config.kv_cache_memory_bytes // bytes_per_block
            budget_source = f"kv_cache_memory_bytes={cache_config.kv_cache_memory_bytes}"
        elif gpu_budget_bytes is not None:
            num_blocks = gpu_budget_bytes // bytes_per_block
            budget_source = f"gpu_memory_utilization={cache_config.gpu_memory_utilization}"
        else:
            budget = int(available_memory_bytes(device) * cache_config.kv_cache_memory_fraction)
            num_blocks = min(budget // bytes_per_block, blocks_per_seq * max_num_seqs)
            budget_source = f"{cache_config.kv_cache_memory_fraction:.0%} of available memory"
    named = cache_config.num_kv_blocks is not None or cache_config.kv_cache_memory_bytes is not None
    if device.type == "cpu" and named:
        _check_fits_in_memory(num_blocks * bytes_per_block, budget_source, device)
    check_pool_holds_one_request(num_blocks, block_size, max_model_len, budget_source)
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s); "
        "maximum concurrency at %d tokens per request: %.1fx",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * bytes_per_block / (1 << 30),
        budget_source,
        max_model_len,
        num_blocks / blocks_per_seq,
    )
    return num_blocks


def _check_fits_in_memory(pool_bytes: int, budget_source: str, device: torch.device) -> None:
    """A named CPU budget larger than the memory there is: refused at start. The
    pool is reserved untouched, so it started, and the OOM killer ended the
    engine once requests had filled it."""
    available = available_memory_bytes(device)
    if pool_bytes > available:
        raise ValueError(f"the KV cache ({pool_bytes / _GIB:.2f} GiB, from {budget_source}) is more than the "
                         f"memory available ({available / _GIB:.2f} GiB, within this process's memory limit): it "
                         "would be killed once requests fill it; give it less")
