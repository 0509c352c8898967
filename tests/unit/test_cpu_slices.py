"""The CPUs each local data-parallel engine core gets (engine/cpu_slices.py):
every rank took every core, so N engine cores on one host ran N spinning
OpenMP threads per core (DP=2 on 2 cores: 23-31 output tokens/s against
172-181 with a CPU each, BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from heron.engine import cpu_slices
from heron.engine.cpu_slices import describe, pin, rank_cpu_slices, slice_environment


@pytest.mark.parametrize("cpus, ranks, expected", [
    ({0, 1}, 2, [[0], [1]]),
    ({0, 1, 2, 3, 4}, 2, [[0, 1], [2, 3]]),  # the one left over stays with the API server
    ({2, 3, 6, 7}, 2, [[2, 3], [6, 7]]),  # the launcher's own set (taskset, a container's cpuset)
    ({0, 1}, 3, [[0], [1], [0]]),  # fewer CPUs than ranks: one each, round the CPUs
    ({0, 1, 2, 3}, 1, None),  # one rank takes every CPU
])
def test_each_rank_gets_its_own_slice_of_the_launchers_cpus(monkeypatch, cpus, ranks, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_slices.os, "sched_getaffinity", lambda pid: cpus)
    assert rank_cpu_slices(ranks) == expected


def test_the_users_omp_num_threads_leaves_placement_to_the_user(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert rank_cpu_slices(2) is None
    assert slice_environment(None) is None


def test_a_started_process_runs_on_its_slice_with_as_many_threads():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; time.sleep(0.3); "
         "print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"],
        env=slice_environment([cpu]), stdout=subprocess.PIPE, text=True)
    pin(child.pid, [cpu])
    out, _ = child.communicate(timeout=30)
    assert out.split() == [f"[{cpu}]", "1"]
    assert describe([0, 1, 2, 3]) == "0-3" and describe([0, 2]) == "0,2" and describe([5]) == "5"
