"""Time of the host tier's copies (``worker/kv_offload_store.HostKVStore``):
saving N pool blocks to the tier and loading N back, on the pool's device, with
the layout of the random-weight Llama-3.2-1B shape (16 layers, 8 KV heads,
head_dim 64, bf16, 16-token blocks: 32 KB per token) by default.

    python benchmarks/kv_host_tier_copy_time.py --device cuda --blocks 219

Prints one line per case: ms per apply (median of --repeats, the device synced),
and GB/s of K/V moved. Cases: consecutive slots (one run per layer, the usual
case) and scattered slots (every block its own run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from heron.core.kv_offload import KVTransfers  # noqa: E402
from heron.worker.kv_offload_store import HostKVStore  # noqa: E402


def timed(store: HostKVStore, transfers: KVTransfers, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        store.apply(transfers)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=219)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--pool-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    caches = [torch.randn(2, args.pool_blocks, 16, args.kv_heads, args.head_dim, device=device).to(torch.bfloat16)
              for _ in range(args.layers)]
    store = HostKVStore(caches, num_slots=4 * args.blocks)
    nbytes = args.blocks * sum(cache[:, 0].numel() * cache.element_size() for cache in caches)
    generator = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(args.pool_blocks, generator=generator)[:args.blocks].tolist()
    scattered = (torch.randperm(2 * args.blocks, generator=generator)[:args.blocks] * 2).tolist()
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"tier pinned: {getattr(store, 'pinned', None)}, {args.blocks} blocks = {nbytes / 1e6:.1f} MB")
    for name, slots in (("consecutive slots", list(range(args.blocks))), ("scattered slots", scattered)):
        save = timed(store, KVTransfers(saves=list(zip(block_ids, slots, strict=True))), device, args.repeats)
        load = timed(store, KVTransfers(loads=list(zip(slots, block_ids, strict=True))), device, args.repeats)
        print(f"{name}: save {1000 * save:.2f} ms ({nbytes / save / 1e9:.1f} GB/s), "
              f"load {1000 * load:.2f} ms ({nbytes / load / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
