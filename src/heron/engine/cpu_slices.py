"""The CPUs each local engine core of ``--data-parallel-size N`` runs on.

Every engine core's kernels run on as many OpenMP threads as the process may
use cores, and those threads spin at each of a step's barriers before they
sleep. N engine cores on one host each took every core: N spinning threads per
core, each holding the core its partner needs (the trap README's "Cores of its
own" describes, set by heron itself). Each rank now gets its own consecutive
slice of the launcher's CPUs (``os.sched_getaffinity``), as many OpenMP threads
as its slice holds, and is pinned to it; CPUs left over stay with the API
server. Fewer CPUs than ranks: one CPU each, round the CPUs (one thread per
rank, so no barrier spins against a partner).

``OMP_NUM_THREADS`` set by the user means the user places the threads: heron
then neither splits nor pins. Ray engine cores get their threads from their
bundle (``ray_engines.py``) and Ray places them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

OMP_NUM_THREADS = "OMP_NUM_THREADS"


def rank_cpu_slices(ranks: int) -> list[list[int]] | None:
    """The CPUs of each of ``ranks`` local engine cores, or None: one rank (it
    takes every CPU), the user's ``OMP_NUM_THREADS``, or no CPU affinity here."""
    if ranks <= 1 or OMP_NUM_THREADS in os.environ or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return [[cpus[rank % len(cpus)]] for rank in range(ranks)]
    per_rank = len(cpus) // ranks
    return [cpus[rank * per_rank:(rank + 1) * per_rank] for rank in range(ranks)]


def slice_environment(cpus: Sequence[int] | None) -> dict[str, str] | None:
    """The environment of an engine core on ``cpus`` (None: this process's, unchanged)."""
    if not cpus:
        return None
    return {**os.environ, OMP_NUM_THREADS: str(len(cpus))}


def pin(pid: int, cpus: Sequence[int] | None) -> None:
    """Pin a just-started process (it has no thread yet: those it starts inherit the set)."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:  # gone already, or a set this host refuses: it runs unpinned, on its thread count
        logger.warning("could not pin engine core %d to CPUs %s: %s", pid, list(cpus), exc)


def describe(cpus: Sequence[int]) -> str:
    """``0-3`` for a consecutive slice, else the list."""
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(cpu) for cpu in cpus)
