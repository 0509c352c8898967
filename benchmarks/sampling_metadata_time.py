"""Host time to build a step's sampling metadata for a decode batch: rebuilt from
every request's parameters (``build_sampling_metadata``) against the runner's
``SamplingMetadataBuilder``, which keeps the parameters' part while the batch
holds the same requests in the same order. No model, CPU tensors.

    PYTHONPATH=src:. python3 benchmarks/sampling_metadata_time.py [--batch 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from heron.core.scheduler_output import NewRequestData  # noqa: E402
from heron.sampling_params import SamplingParams  # noqa: E402
from heron.worker.request_state import CachedRequestState  # noqa: E402
from heron.worker.sampling_metadata import SamplingMetadataBuilder, build_sampling_metadata  # noqa: E402

VOCAB = 128256
MIXES = {
    "greedy": SamplingParams(temperature=0, max_tokens=500),
    "top-p/top-k": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=500),
}


def decode_states(params: SamplingParams, batch: int) -> list[CachedRequestState]:
    return [
        CachedRequestState.from_new_request(
            NewRequestData(request_id=f"r{i}", token_ids=[1, 2, 3, 4], num_prompt_tokens=3, sampling_params=params,
                           eos_token_ids=frozenset({2}), block_ids=[0], num_computed_tokens=0),
            torch.device("cpu"),
        )
        for i in range(batch)
    ]


def best_us(build, repeats: int = 5, calls: int = 200) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            build()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    for name, params in MIXES.items():
        states = decode_states(params, args.batch)
        builder = SamplingMetadataBuilder(VOCAB, cpu)
        rebuilt = best_us(lambda states=states: build_sampling_metadata(states, VOCAB, cpu))
        kept = best_us(lambda builder=builder, states=states: builder.build(states))
        print(f"{name}, batch {args.batch}: rebuilt {rebuilt:.0f} us, kept {kept:.0f} us per step (best of 5 x 200)")


if __name__ == "__main__":
    main()
