"""CPU use of a few processes while something runs, read from /proc (Linux):
``ProcessCpuSampler`` samples each process's user + system clock ticks every
``interval_s`` in a thread and reports, per process, the mean % of one core over
the window where the first process (the API server) was busy, and the busiest
second. For serving benchmarks: at high concurrency the API server or the bench
client can saturate a core before the engine does."""

from __future__ import annotations

import os
import threading
import time

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_ticks(pid: int) -> int | None:
    """User + system clock ticks of ``pid`` so far; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return children


def child_running(pid: int, needle: str) -> int | None:
    """The first direct child of ``pid`` whose command line contains ``needle``."""
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as handle:
                if needle.encode() in handle.read():
                    return child
        except OSError:
            continue
    return None


class ProcessCpuSampler:
    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), {name: cpu_ticks(pid) for name, pid in self.pids.items()}))
            if self._stop.wait(self.interval_s):
                self.samples.append((time.monotonic(), {name: cpu_ticks(pid) for name, pid in self.pids.items()}))
                return

    def report(self, duration_s: float | None = None) -> dict[str, float]:
        """``{name}_cpu_pct_mean`` and ``{name}_cpu_pct_max_1s`` per process (% of one
        core), over the samples from the first to the last change of the first
        process's ticks, or only the last ``duration_s`` of that (a benchmark's
        timed run, without its set-up); empty if the first process never ran."""
        first = next(iter(self.pids))
        rows = [(t, ticks) for t, ticks in self.samples if all(v is not None for v in ticks.values())]
        busy = [i for i in range(1, len(rows)) if rows[i][1][first] != rows[i - 1][1][first]]
        if not busy:
            return {}
        start = busy[0] - 1
        if duration_s is not None:
            end_time = rows[busy[-1]][0]
            window_start = end_time - duration_s - self.interval_s
            start = max(start, next(i for i in range(len(rows)) if rows[i][0] >= window_start))
        window = rows[start : busy[-1] + 1]
        if len(window) < 2:
            return {}
        per_second = max(1, round(1.0 / self.interval_s))
        result: dict[str, float] = {"cpu_window_s": window[-1][0] - window[0][0]}
        for name in self.pids:
            def pct(a: int, b: int, name: str = name) -> float:
                (t0, v0), (t1, v1) = window[a], window[b]
                return 100.0 * (v1[name] - v0[name]) / _TICKS_PER_S / max(t1 - t0, 1e-9)  # type: ignore[operator]

            result[f"{name}_cpu_pct_mean"] = pct(0, len(window) - 1)
            seconds = [pct(i, i + per_second) for i in range(len(window) - per_second)]
            result[f"{name}_cpu_pct_max_1s"] = max(seconds) if seconds else result[f"{name}_cpu_pct_mean"]
        return result
