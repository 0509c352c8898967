"""What copying a prompt's blocks out of and into the pool costs, as the tree
it runs on does it (``worker/kv_block_codec.py``): since 2026-11-25 all blocks
at once, a copy or two per layer; before, one block per call, a copy per block
and layer (run it on an older tree with ``PYTHONPATH=<worktree>/src``).

The pool has the embedded model's shape (30 layers, 3 KV heads of 64, blocks
of 16 tokens, float16); 123 blocks are a 1,972-token prompt's full blocks.
Torch runs on one thread, as the disk tier's and the puller's background
threads' copies compete with the step loop for the cores. Reported: wall
time, median of --rounds.

    python benchmarks/kv_block_copy_time.py
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from statistics import median

import torch

from heron.worker.kv_block_codec import BlockCodec


def blocks_at_once(codec: BlockCodec) -> bool:
    return "block_ids" in inspect.signature(codec.capture).parameters


def capture(codec: BlockCodec, blocks: list[int]) -> torch.Tensor | list[torch.Tensor]:
    if blocks_at_once(codec):
        return codec.capture(blocks)
    return [codec.capture(block) for block in blocks]  # type: ignore[arg-type]


def restore(codec: BlockCodec, rows: torch.Tensor | list[torch.Tensor], blocks: list[int]) -> None:
    if isinstance(rows, torch.Tensor):
        codec.restore(rows, blocks)
    else:
        for row, block in zip(rows, blocks):
            codec.restore(row, block)  # type: ignore[arg-type]


def timed_ms(work) -> float:
    started = time.perf_counter()
    work()
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=123)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    caches = [torch.randn(2, 2 * args.blocks, 16, 3, 64).to(torch.float16) for _ in range(args.layers)]
    codec = BlockCodec(caches)
    source, target = list(range(args.blocks)), list(range(args.blocks, 2 * args.blocks))
    rows = capture(codec, source)
    captures = [timed_ms(lambda: capture(codec, source)) for _ in range(args.rounds)]
    restores = [timed_ms(lambda: restore(codec, rows, target)) for _ in range(args.rounds)]
    print(json.dumps({"blocks_at_once": blocks_at_once(codec), "blocks": args.blocks, "layers": args.layers,
                      "block_bytes": codec.block_bytes, "capture_ms": median(captures),
                      "restore_ms": median(restores)}, indent=1))


if __name__ == "__main__":
    main()
