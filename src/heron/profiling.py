"""Profiling hooks: named engine phases and a torch-profiler window.

``phase("forward")`` marks a region for the torch profiler (record_function) and,
on CUDA, as an NVTX range so Nsight Systems shows the engine's phases.
``StepProfiler`` records a window of engine steps and writes a Chrome trace
(open it in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def _profiler_enabled() -> bool:
    # the C++ state: true for torch.profiler.profile, emit_nvtx and on-demand traces alike
    return torch._C._autograd._profiler_enabled()


_NVTX: bool | None = None  # CUDA present: mark phases as NVTX ranges (decided on first use)


class phase:
    """``with phase("forward"):`` marks an engine phase. It costs next to nothing
    when no torch profiler is recording (it runs several times per step: a
    ``record_function`` each time would cost tens of microseconds per step)."""

    __slots__ = ("name", "_record")

    def __init__(self, name: str) -> None:
        self.name = name
        self._record: torch.profiler.record_function | None = None

    def __enter__(self) -> None:
        global _NVTX
        if _NVTX is None:
            _NVTX = torch.cuda.is_available()
        if _NVTX:
            torch.cuda.nvtx.range_push(self.name)
        if _profiler_enabled():
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        if self._record is not None:
            self._record.__exit__(*exc_info)
            self._record = None
        if _NVTX:
            torch.cuda.nvtx.range_pop()


# the names ``phase`` marks in an engine step (LLMEngine.step: the engine core's
# phases, then the output processor's)
ENGINE_PHASES = (
    "schedule", "prepare_inputs", "forward", "sample", "wait_for_output", "update_from_output", "process_outputs",
)


def phase_times_ms(step: Callable[[], object], num_steps: int) -> dict[str, float]:
    """Host milliseconds per step spent in each of ``ENGINE_PHASES`` (0.0 for a
    phase that did not run), over ``num_steps`` calls of ``step`` under the torch
    profiler (CPU activity only)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(num_steps):
            step()
    totals = {e.key: e.cpu_time_total for e in profile.key_averages() if e.key in ENGINE_PHASES}
    return {name: totals.get(name, 0.0) / num_steps / 1000 for name in ENGINE_PHASES}


class StepProfiler:
    """Profiles engine steps ``[start_step, start_step + num_steps)``."""

    def __init__(self, directory: str, num_steps: int = 32, start_step: int = 0) -> None:
        self.directory = directory
        self.num_steps = num_steps
        self.start_step = start_step
        self.step_index = 0
        self.trace_path: str | None = None
        self._profiler: torch.profiler.profile | None = None

    @property
    def done(self) -> bool:
        return self.trace_path is not None

    def before_step(self) -> None:
        if self.done or self._profiler is not None or self.step_index < self.start_step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._profiler.__enter__()

    def after_step(self) -> None:
        self.step_index += 1
        if self._profiler is not None and self.step_index >= self.start_step + self.num_steps:
            self.finish()

    def finish(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"heron-trace-{os.getpid()}-{int(time.time())}.json")
        profiler.export_chrome_trace(path)
        self.trace_path = path
        logger.info("wrote a profile of %d engine steps to %s", self.num_steps, path)
