"""Decode time per token of the embedded model (int4, native steps, batch 1)
under OpenMP's wait policies, on an idle machine and beside a busy process.

heron's C kernels open an OpenMP parallel region per layer, so a step holds
hundreds of barriers; GNU OpenMP's threads spin at a barrier before they sleep
(``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``). On cores of their own that is the
fastest; when another process wants one of them, a spinning thread holds the
core its partner needs. Each configuration runs in a fresh process (the policy
is read when the OpenMP runtime starts).

    python benchmarks/omp_wait_policy.py [--busy N] [--tokens 48] [--repeats 5]

``--busy N`` starts N busy-looping processes beside each run (and stops them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

POLICIES = {
    "default": {},
    "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}


def time_one(tokens: int, repeats: int) -> list[float]:
    """Milliseconds per token of each repeat (in this process)."""
    from heron import LLM, SamplingParams

    llm = LLM(max_model_len=512)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompt = "Tell me about the history of the city of Kyoto in Japan."
    llm.generate([prompt], params, use_tqdm=False)  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append((time.perf_counter() - started) / tokens * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child run: print its times
    args = parser.parse_args()
    if args.one:
        print(" ".join(f"{t:.2f}" for t in time_one(args.tokens, args.repeats)))
        return
    for name, env in POLICIES.items():
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            out = subprocess.run([sys.executable, __file__, "--one", name, "--tokens", str(args.tokens),
                                  "--repeats", str(args.repeats)], env={**os.environ, **env},
                                 capture_output=True, text=True, check=True).stdout.split()
        finally:
            for process in busy:
                process.kill()
                process.wait()
        times = [float(value) for value in out]
        print(f"{name:24s} busy={args.busy}  ms/token median {statistics.median(times):6.2f}  "
              f"runs {' '.join(f'{t:.1f}' for t in times)}", flush=True)


if __name__ == "__main__":
    main()
