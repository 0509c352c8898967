"""What racing each send to the engine core against the engine's death costs
AsyncLLM per request (``AsyncLLM._send_unless_dead``), as cited in
BENCHMARKS.md: a loop of sends that complete at once, awaited directly and
through the race, alternated.

    python benchmarks/send_race_cost.py [--sends 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from heron.engine.async_llm import AsyncLLM


async def measure(sends: int) -> None:
    llm = AsyncLLM.__new__(AsyncLLM)  # only the race's state: no engine
    llm._dead = asyncio.get_running_loop().create_future()
    llm.dead_reason = None

    async def send() -> None:
        return None

    for label in ("direct", "raced") * 2:
        started = time.perf_counter()
        for _ in range(sends):
            if label == "direct":
                await send()
            else:
                await llm._send_unless_dead(send())
        print(f"{label}: {(time.perf_counter() - started) / sends * 1e6:.1f} us per send")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sends", type=int, default=20000)
    asyncio.run(measure(parser.parse_args().sends))


if __name__ == "__main__":
    main()
