"""An engine-core process (``engine/core_proc.py``) whose first step waits
until a file exists: a step that does not end, for the heartbeat's test
(tests/model/test_engine_heartbeat.py).

    python tests/model/held_step_engine_core.py START_PICKLE LOG_LEVEL RELEASE_PATH
"""

from __future__ import annotations

import os
import sys
import time

from heron.engine.core import EngineCore
from heron.engine.core_proc import main


def hold_first_step(release_path: str) -> None:
    real_step = EngineCore.step
    held: list[bool] = []

    def step(self: EngineCore):  # type: ignore[no-untyped-def]
        if not held:
            held.append(True)
            while not os.path.exists(release_path):
                time.sleep(0.05)
        return real_step(self)

    EngineCore.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_first_step(sys.argv[3])
    main(sys.argv[1:3])
