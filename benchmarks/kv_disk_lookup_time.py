"""How long a disk KV tier's lookup holds the step loop when another replica
wrote the prompt's blocks (issue 19): the index does not know them, so each is
a ``stat`` of the file system, a round trip on a network one.

A "writer" path makes --blocks block files (a prompt's run); a fresh index on
the "reader" path (the same directory through another mount, to stand for
another host) then looks the run up as the scheduler does: each step walks
the run until a block is missing or not known yet; between steps it waits
for the background lookups, if any. Reported per round: the time the step
loop spent inside lookups (what every running request waits for), in all and
in its longest step, and the time until the whole run was known. On trees before the background lookups
(no ``DiskIndex.lookup``), the run is walked with ``in``, one stat per block.

    python benchmarks/kv_disk_lookup_time.py --dir /mnt/a --other-dir /mnt/b

Each round uses fresh hashes in a fresh sub-directory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from statistics import median

from heron.core.kv_disk_index import DiskIndex
from heron.core.kv_disk_layout import DiskTierLayout

PAYLOAD = 4096  # a stat does not read the file: its size does not matter here


def write_run(layout: DiskTierLayout, hashes: list[bytes]) -> None:
    payload = bytes(PAYLOAD)
    for block_hash in hashes:
        path = layout.path_for(block_hash)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(layout.header(block_hash, payload) + payload)


def walk(index: DiskIndex, run: list[bytes]) -> int | None:
    """How many leading blocks the tier holds; None: not known yet."""
    for position in range(len(run)):
        if hasattr(index, "lookup"):
            held = index.lookup(run[position:])
        else:
            held = run[position] in index  # type: ignore[operator]
        if held is None:
            return None
        if not held:
            return position
    return len(run)


def one_round(writer_dir: Path, reader_dir: Path, num_blocks: int) -> dict:
    name = f"lookup-{uuid.uuid4().hex[:8]}"
    fingerprint = os.urandom(16)
    writer = DiskTierLayout.create(writer_dir / name, fingerprint, PAYLOAD)
    reader = DiskTierLayout.create(reader_dir / name, fingerprint, PAYLOAD)
    index = DiskIndex(reader, 1 << 30)  # built before the files exist: it knows none of them
    run = [os.urandom(32) for _ in range(num_blocks)] + [os.urandom(32)]  # the last: not on disk
    write_run(writer, run[:-1])
    in_lookups = longest_step = 0.0
    steps = 0
    started = time.perf_counter()
    while True:
        steps += 1
        step_started = time.perf_counter()
        found = walk(index, run)
        step_seconds = time.perf_counter() - step_started
        in_lookups += step_seconds
        longest_step = max(longest_step, step_seconds)
        if hasattr(index, "take_ops"):
            index.take_ops()  # the step is emitted: a new budget
        if found is not None:
            break
        index.wait_for_probe(0.02)
    elapsed = time.perf_counter() - started
    if hasattr(index, "close"):
        index.close()
    assert found == num_blocks, found
    return {"step_loop_ms": 1000 * in_lookups, "longest_step_ms": 1000 * longest_step,
            "known_after_ms": 1000 * elapsed, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="the writer's path to the directory")
    parser.add_argument("--other-dir", default=None, help="the reader's path to it (default: --dir)")
    parser.add_argument("--blocks", type=int, default=123, help="a 1,972-token prompt's full blocks")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    writer_dir, reader_dir = Path(args.dir), Path(args.other_dir or args.dir)
    rounds = [one_round(writer_dir, reader_dir, args.blocks) for _ in range(args.rounds)]
    keys = ("step_loop_ms", "longest_step_ms", "known_after_ms", "steps")
    summary = {key: median(result[key] for result in rounds) for key in keys}
    print(json.dumps({"median": summary, "rounds": rounds}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "median": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
