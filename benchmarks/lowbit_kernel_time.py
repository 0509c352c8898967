"""Time heron's low-bit C kernels alone, as in BENCHMARKS.md's session-4 table:
30 layers' worth of distinct 4-bit weights (the embedded model's shapes, too
large for the cache, so DRAM-bound like a real step) at 1, 4, 16, 32 and 64 rows,
and the int4 mode's LM head (49152 x 576) at 1 to 128 rows against the bf16 int8 head.
Works on the weight layout of any commit since session 4 (``packed`` before the
column tiles of session 5, ``tiles`` since).

    python benchmarks/lowbit_kernel_time.py
"""

from __future__ import annotations

import time

import torch

from heron.kernels.cpu.ops import q4_linear
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def best_ms(function, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    layers = [Int4WeightOnlyLinear(torch.randn(n, k) * 0.05) for n, k in shapes]
    for rows in (1, 4, 16, 32, 64):
        inputs = [torch.randn(rows, layer.in_features) for layer in layers]

        def all_layers(layers: list[Int4WeightOnlyLinear] = layers, inputs: list[torch.Tensor] = inputs) -> None:
            for layer, x in zip(layers, inputs):
                if hasattr(layer, "tiles"):
                    q4_linear(x, layer.tiles, layer.scales, layer.mins)
                elif x.shape[0] <= 16:  # session 4: the dot-product kernel up to 16 rows
                    q4_linear(x, layer.packed, layer.scales, layer.mins)
                else:  # and the float32 GEMM on rounded inputs above
                    layer(x)

        print(f"4-bit linears, 30 layers, {rows} rows: {best_ms(all_layers):.2f} ms")
    del layers, all_layers  # all_layers holds the layers too, as a default
    weight = torch.randn(49152, 576) * 0.05
    heads = [Int8WeightOnlyLinear]
    try:
        from heron.models.quantization import Int8WeightInt8InputLinear

        heads.append(Int8WeightInt8InputLinear)
    except ImportError:  # before session 4
        pass
    for cls in heads:
        head = cls(weight)
        for rows in (1, 4, 8, 16, 32, 64, 128):
            x = torch.randn(rows, 576)
            ms = best_ms(lambda head=head, x=x: [head(x) for _ in range(5)]) / 5
            print(f"LM head {cls.__name__}, {rows} rows: {ms:.2f} ms")


if __name__ == "__main__":
    main()
