"""Time heron's paged decode attention kernel alone, as in BENCHMARKS.md's
session-5 section: 30 layers' worth of distinct float32 KV caches (too large for
the cache, so DRAM-bound like a real step), a batch of sequences of one context
length, blocks scattered at random, SmolLM2-135M's heads (9 query, 3 KV, 64).

    python benchmarks/paged_attention_time.py [--batch 64] [--context 350]

``--chunk N`` times one request's prefill chunk instead: N consecutive tokens
ending at ``--context``, each over the cached context before it (as a native
step attends a chunk), e.g. ``--chunk 512 --context 2048 --cache-dtype float16``.
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
    parser.add_argument("--chunk", type=int, default=0, help="one request's N chunk tokens instead of a batch")
    parser.add_argument("--cache-dtype", choices=["float32", "float16"], default="float32")
    args = parser.parse_args()
    if args.chunk:
        args.batch = 1
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.batch * blocks_per_seq + 10
    dtype = getattr(torch, args.cache_dtype)
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype) for _ in range(30)]
    block_table = (torch.randperm(num_blocks)[: args.batch * blocks_per_seq]
                   .view(args.batch, blocks_per_seq).contiguous())
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    table_rows = None
    if args.chunk:  # rows: the chunk's tokens, all in block-table row 0, one position apart
        seq_lens = torch.arange(args.context - args.chunk + 1, args.context + 1, dtype=torch.int64)
        table_rows = torch.zeros(args.chunk, dtype=torch.int64)
    query = torch.randn(len(seq_lens), num_heads, head_dim)

    def all_layers() -> None:
        for cache in caches:
            cpu_kernels.paged_decode_attention(query, cache, block_table, seq_lens, head_dim**-0.5, None,
                                               table_rows=table_rows)

    all_layers()
    started = time.perf_counter()
    for _ in range(args.repeats):
        all_layers()
    seconds = (time.perf_counter() - started) / args.repeats
    if args.chunk:
        print(f"30 layers, a {args.chunk}-token chunk ending at context {args.context} ({args.cache_dtype} cache): "
              f"{seconds * 1000:.1f} ms")
        return
    kv_bytes = args.batch * args.context * num_kv_heads * head_dim * 2 * caches[0].element_size() * 30
    print(f"30 layers, batch {args.batch}, context {args.context}: {seconds * 1000:.1f} ms "
          f"({kv_bytes / seconds / 1e9:.1f} GB/s of K/V)")


if __name__ == "__main__":
    main()
