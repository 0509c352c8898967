"""Time heron's paged decode attention kernel alone, as in BENCHMARKS.md's
session-5 section: 30 layers' worth of distinct float32 KV caches (too large for
the cache, so DRAM-bound like a real step), a batch of sequences of one context
length, blocks scattered at random, SmolLM2-135M's heads (9 query, 3 KV, 64).

    python benchmarks/paged_attention_time.py [--batch 64] [--context 350]
"""

from __future__ import annotations

import argparse
import time

import torch

from heron.kernels.cpu import ops as cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_seq + 10
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) for _ in range(30)]
    block_table = torch.randperm(num_blocks)[: args.batch * blocks_per_seq].view(args.batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    query = torch.randn(args.batch, num_heads, head_dim)

    def all_layers() -> None:
        for cache in caches:
            cpu_kernels.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, None)

    all_layers()
    started = time.perf_counter()
    for _ in range(args.repeats):
        all_layers()
    seconds = (time.perf_counter() - started) / args.repeats
    kv_bytes = args.batch * args.context * num_kv_heads * head_dim * 2 * 4 * 30
    print(f"30 layers, batch {args.batch}, context {args.context}: {seconds * 1000:.1f} ms "
          f"({kv_bytes / seconds / 1e9:.1f} GB/s of K/V)")


if __name__ == "__main__":
    main()
