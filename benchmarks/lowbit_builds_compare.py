"""The low-bit kernels of several instruction-set builds side by side in one
process (alternated; best and median of --repeats), as cited in BENCHMARKS.md:
30 layers of the embedded model's 4-bit linears and its int8 LM head at several
row counts. One process, so the machine's process-to-process noise cancels out.
``--base-src DIR`` adds each build compiled from another tree's sources (its
``src`` folder, e.g. a ``git worktree``) with the same flags, labelled ``ISA@base``.

    python benchmarks/lowbit_builds_compare.py --isa avx2 --isa avx512 --isa avx512_vnni [--rows 1,4,8,32,283]
    git worktree add /tmp/base REV && python benchmarks/lowbit_builds_compare.py --isa avx2 --base-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from heron.kernels.cpu.isa import ISAS
from heron.kernels.cpu.library import load_library
from heron.kernels.cpu.ops import q4_linear, q8_linear
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightInt8InputLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) of the embedded model's layers


def timed_ms(function: Callable[[], Any]) -> float:
    started = time.perf_counter()
    function()
    return (time.perf_counter() - started) * 1000


def summary(times: list[float]) -> str:
    return f"{min(times):.2f} ({statistics.median(times):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", action="append", choices=ISAS, required=True)
    parser.add_argument("--rows", default="1,4,8,32,283")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--base-src", default=None, help="another tree's src folder: its builds too, as ISA@base")
    args = parser.parse_args()
    libraries = {isa: load_library(isa) for isa in args.isa}
    if args.base_src:  # the other tree's kernel sources, built with this tree's flags
        csrc = os.path.join(args.base_src, "heron", "kernels", "cpu", "csrc")
        libraries.update({f"{isa}@base": load_library(isa, source_dir=csrc) for isa in args.isa})
    torch.manual_seed(0)
    layers = [Int4WeightOnlyLinear(torch.randn(n, k) * 0.05) for n, k in SHAPES]
    head = Int8WeightInt8InputLinear(torch.randn(49152, 576) * 0.05)
    print("rows | " + " | ".join(f"{isa} int4 layers / LM head, ms: best (median)" for isa in libraries))
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, layer.in_features) for layer in layers]
        head_input = torch.randn(rows, 576)
        linear_ms: dict[str, list[float]] = {isa: [] for isa in libraries}
        head_ms: dict[str, list[float]] = {isa: [] for isa in libraries}
        for repeat in range(args.repeats):
            order = list(libraries.items())
            for isa, library in order if repeat % 2 == 0 else reversed(order):
                linear_ms[isa].append(timed_ms(lambda library=library, inputs=inputs: [
                    q4_linear(x, layer.tiles, layer.scales, layer.mins, library=library)
                    for layer, x in zip(layers, inputs)]))
                head_ms[isa].append(timed_ms(lambda library=library, head_input=head_input: q8_linear(
                    head_input, head.tiles, head.scales, library=library)))
        print(f"{rows} | " + " | ".join(f"{summary(linear_ms[isa])} / {summary(head_ms[isa])}" for isa in libraries))


if __name__ == "__main__":
    main()
