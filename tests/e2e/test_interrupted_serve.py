"""A Ctrl-C (or SIGTERM) while ``heron serve`` builds its app, after the event
loop started and before uvicorn installed its handlers, stops it gracefully:
exit 0, no traceback, no engine core left. asyncio.run's own SIGINT handler was
in place then: it cancelled the task, uvicorn's lifespan start-up logged the
CancelledError as an error traceback, and heron exited 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

# heron serve, with a signal raised at the end of building the app (a window of a second or more in a real start)
SCRIPT = textwrap.dedent("""
    import signal, sys
    from heron.entrypoints import cli
    from heron.entrypoints.openai import server

    build_app = server.build_app

    def build_app_then_signal(*args, **kwargs):
        app = build_app(*args, **kwargs)
        signal.raise_signal(int(sys.argv[1]))
        return app

    server.build_app = build_app_then_signal
    sys.exit(cli.main(["serve", "--port", "0", "--max-model-len", "256"]))
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_the_app_is_built_stops_it_gracefully(signum):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(int(signum))], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _, stderr = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
    assert "heron is ready" not in stderr  # it stopped before it served
    # its engine core was stopped with it (a core's last argument is its launcher's pid)
    cores = subprocess.run(["pgrep", "-f", f"heron.engine.core_proc .* {process.pid}$"], capture_output=True, text=True)
    assert cores.stdout == ""
