"""What a CPU KV pool's first touch costs a prompt: two engines of the embedded
model in one process, alternating 306-token prefills (distinct prompts, so every
prefill writes blocks its engine never used: the default pool holds about 5 GiB,
and blocks are handed out least recently used first), one with the pool as
heron allocates it (private anonymous memory in 4 KiB pages) and one with
``np.zeros`` (numpy asks for transparent huge pages for large arrays, as the pool
was allocated before). Per engine: prefill wall time (best, median, mean, p90),
and per prefill the minor page faults and system CPU time (the process's own
rusage around each call; the engine runs in this process).

    python benchmarks/kv_pool_first_touch.py [--prompts 50] [--prompt-len 306] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from collections.abc import Callable

import numpy as np
import torch

import heron.worker.kv_cache_sizing as sizing
from heron import LLM, SamplingParams


def numpy_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pool as allocated before: ``np.zeros`` (calloc; huge pages where numpy asks for them)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(int(np.prod(shape)) * element_size, dtype=np.uint8)).view(dtype).view(shape)


def engine_with(allocate: Callable[..., torch.Tensor]) -> LLM:
    heron_zeroed = sizing.zeroed
    sizing.zeroed = allocate
    try:
        return LLM(max_model_len=1024)
    finally:
        sizing.zeroed = heron_zeroed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50, help="prefills per engine")
    parser.add_argument("--prompt-len", type=int, default=306)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    engines = {"np.zeros (huge pages)": engine_with(numpy_zeroed), "4 KiB pages (heron)": engine_with(sizing.zeroed)}
    rng = random.Random(args.seed)
    first = SamplingParams(temperature=0, max_tokens=1)

    def prompt() -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(args.prompt_len)]

    for llm in engines.values():  # warm-up
        for _ in range(3):
            llm.generate([prompt()], first, use_tqdm=False)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    faults = dict.fromkeys(engines, 0)
    system = dict.fromkeys(engines, 0.0)
    order = list(engines.items())
    for index in range(args.prompts):
        for name, llm in order if index % 2 else reversed(order):
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            llm.generate([prompt()], first, use_tqdm=False)
            seconds[name].append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[name] += after.ru_minflt - before.ru_minflt
            system[name] += after.ru_stime - before.ru_stime
    print(f"{args.prompt_len}-token prefills over never-used blocks, {args.prompts} per pool, alternated:")
    for name, times in seconds.items():
        ordered, count = sorted(times), len(times)
        print(f"{name}: best {ordered[0] * 1e3:.0f} median {ordered[count // 2] * 1e3:.0f} "
              f"mean {sum(ordered) / count * 1e3:.0f} p90 {ordered[int(count * 0.9)] * 1e3:.0f} ms; per prefill "
              f"{faults[name] / count:.0f} minor faults, {system[name] / count * 1e3:.1f} ms system CPU")


if __name__ == "__main__":
    main()
