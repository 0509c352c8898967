"""The low-bit kernels of several instruction-set builds side by side in one
process (alternated, best of 7), as cited in BENCHMARKS.md: 30 layers of the
embedded model's 4-bit linears and its int8 LM head at several row counts.
One process, so the machine's process-to-process noise cancels out.

    python benchmarks/lowbit_builds_compare.py --isa avx2 --isa avx512 --isa avx512_vnni [--rows 1,4,8,32,283]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from heron.kernels.cpu.isa import ISAS
from heron.kernels.cpu.library import load_library
from heron.kernels.cpu.ops import q4_linear, q8_linear
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightInt8InputLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) of the embedded model's layers


def best_ms(function: Callable[[], Any], best: float) -> float:
    started = time.perf_counter()
    function()
    return min(best, (time.perf_counter() - started) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", action="append", choices=ISAS, required=True)
    parser.add_argument("--rows", default="1,4,8,32,283")
    args = parser.parse_args()
    libraries = {isa: load_library(isa) for isa in args.isa}
    torch.manual_seed(0)
    layers = [Int4WeightOnlyLinear(torch.randn(n, k) * 0.05) for n, k in SHAPES]
    head = Int8WeightInt8InputLinear(torch.randn(49152, 576) * 0.05)
    print("rows | " + " | ".join(f"{isa} int4 layers / LM head (ms)" for isa in libraries))
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, layer.in_features) for layer in layers]
        head_input = torch.randn(rows, 576)
        linear_ms = dict.fromkeys(libraries, float("inf"))
        head_ms = dict.fromkeys(libraries, float("inf"))
        for _ in range(7):
            for isa, library in libraries.items():
                linear_ms[isa] = best_ms(lambda library=library, inputs=inputs: [
                    q4_linear(x, layer.tiles, layer.scales, layer.mins, library=library)
                    for layer, x in zip(layers, inputs)], linear_ms[isa])
                head_ms[isa] = best_ms(lambda library=library, head_input=head_input: q8_linear(
                    head_input, head.tiles, head.scales, library=library), head_ms[isa])
        print(f"{rows} | " + " | ".join(f"{linear_ms[isa]:.2f} / {head_ms[isa]:.2f}" for isa in libraries))


if __name__ == "__main__":
    main()
