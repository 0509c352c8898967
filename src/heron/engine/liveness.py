"""Is an engine core that still exists still working?

A process that exists can be of no use: stopped (SIGSTOP, a frozen cgroup), or
stuck inside one step (a deadlock, a hung collective). Its exit is never seen,
so without this /health said ok while every request waited for ever.

The engine core's heartbeat thread sends a HEARTBEAT message every
``HEARTBEAT_INTERVAL_S`` with how long its current step has run. The API
server's side keeps one ``EngineLiveness`` per engine core, fed by every message
it receives, and asks it whether the engine has gone silent (nothing at all for
the heartbeat timeout: the whole process is stopped, or holds the GIL) or is
stuck (one step running past the step timeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

HEARTBEAT_INTERVAL_S = 1.0
# silent this long, an engine core counts as hung: far above a heartbeat's worst delay (a thread of its
# own, waiting for the GIL behind a long Python call in the step)
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


@dataclass(slots=True)
class EngineLiveness:
    """What the API server last heard from one engine core (monotonic times)."""

    last_heard: float | None = None  # None until its first message (it is loading the model)
    step_s_at_beat: float = 0.0  # how long its current step had run at the last heartbeat (0: none running)
    beat_at: float = 0.0

    def heard(self, now: float | None = None) -> None:
        """Any message from the engine core: it is not stopped."""
        self.last_heard = time.monotonic() if now is None else now

    def heartbeat(self, payload: Any, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.heard(now)
        step_s = payload.get("step_s") if isinstance(payload, dict) else None
        self.step_s_at_beat = float(step_s) if isinstance(step_s, (int, float)) else 0.0
        self.beat_at = now

    def hung_reason(self, heartbeat_timeout_s: float, step_timeout_s: float, now: float | None = None) -> str | None:
        """Why the engine core counts as hung, or None. A timeout of 0 checks nothing.
        An engine core never heard from is loading: its process exit is watched instead."""
        if self.last_heard is None:
            return None
        now = time.monotonic() if now is None else now
        silent_s = now - self.last_heard
        if heartbeat_timeout_s > 0 and silent_s > heartbeat_timeout_s:
            return (f"the engine core has sent nothing for {silent_s:.0f} s (--engine-heartbeat-timeout "
                    f"{heartbeat_timeout_s:g}): its process is stopped or hung")
        if step_timeout_s > 0 and self.step_s_at_beat > 0:  # a step was running at the last heartbeat
            step_s = self.step_s_at_beat + (now - self.beat_at)
            if step_s > step_timeout_s:
                return (f"one step of the engine core has run for {step_s:.0f} s (--engine-step-timeout "
                        f"{step_timeout_s:g}): it is stuck")
        return None
