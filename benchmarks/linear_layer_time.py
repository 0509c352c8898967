"""Time all linear layers of the embedded model for one decode step (batch rows
of random activations), split into 4-bit and int8 layers, as in BENCHMARKS.md's
int4 section.

    python benchmarks/linear_layer_time.py --quantization int4 [--rows 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from heron import LLM
from heron.models.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = LLM(max_model_len=512, quantization=args.quantization).engine.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, Int4WeightOnlyLinear, Int8WeightOnlyLinear))]
    inputs = [torch.randn(args.rows, layer.in_features) for layer in layers]
    if args.quantization == "none":  # the tied LM head is the embedding matrix
        layers.append(lambda x: torch.nn.functional.linear(x, model.embed_tokens.weight))
        inputs.append(torch.randn(args.rows, model.embed_tokens.weight.shape[1]))
    for _ in range(args.repeats):
        totals: dict[str, float] = {}
        for layer, x in zip(layers, inputs):
            started = time.perf_counter()
            layer(x)
            kind = type(layer).__name__ if isinstance(layer, nn.Module) else "lm_head"
            totals[kind] = totals.get(kind, 0.0) + time.perf_counter() - started
        parts = ", ".join(f"{kind} {seconds * 1000:.1f} ms" for kind, seconds in totals.items())
        print(f"{args.rows} rows: all linear layers {sum(totals.values()) * 1000:.1f} ms ({parts})")


if __name__ == "__main__":
    main()
