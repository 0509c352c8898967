"""A Ctrl-C (or SIGTERM) while ``heron serve`` builds its app, after the event
loop started and before uvicorn installed its handlers, stops it gracefully:
exit 0, no traceback, no engine core left. asyncio.run's own SIGINT handler was
in place then: it cancelled the task, uvicorn's lifespan start-up logged the
CancelledError as an error traceback, and heron exited 130.

Earlier in a start (between two data-parallel ranks' starts, or while the
server's modules import) a stop signal ends heron at once, and the engine cores
started so far end with it: they went on loading the model for seconds after
heron had exited, until each noticed its launcher gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
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


# heron serve with two data-parallel ranks, with a signal raised once rank 0's engine core has started, before rank 1's
SCRIPT_BETWEEN_RANKS = textwrap.dedent("""
    import signal, sys
    from heron.entrypoints import cli
    from heron.engine.core_client import EngineCoreProcess

    start = EngineCoreProcess.start
    started = []

    def signal_before_the_second_start(*args, **kwargs):
        if started:
            signal.raise_signal(int(sys.argv[1]))
        started.append(start(*args, **kwargs))
        return started[-1]

    EngineCoreProcess.start = staticmethod(signal_before_the_second_start)
    sys.exit(cli.main(["serve", "--port", "0", "--max-model-len", "256", "--data-parallel-size", "2"]))
""")

# heron serve, with a signal raised as the server's modules start to import (after the engine core started)
SCRIPT_IN_IMPORTS = textwrap.dedent("""
    import signal, sys
    from heron.entrypoints import cli

    class SignalOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == "heron.entrypoints.openai.server":
                sys.meta_path.remove(self)
                signal.raise_signal(int(sys.argv[1]))
            return None

    sys.meta_path.insert(0, SignalOnImport())
    sys.exit(cli.main(["serve", "--port", "0", "--max-model-len", "256"]))
""")


def _run_until_it_stops(script: str, signum: int) -> tuple[int, str]:
    """Run ``script``; its exit code and stderr, after checking that no engine core
    it started is left (a core's last argument is its launcher's pid)."""
    # stderr in a file, not a pipe: a pipe's reader waits for every process holding it, engine cores included
    with tempfile.TemporaryFile("w+") as stderr_file:
        process = subprocess.Popen([sys.executable, "-c", script, str(int(signum))], stdout=subprocess.DEVNULL,
                                   stderr=stderr_file, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            process.wait(timeout=180)
        finally:
            process.kill()
        cores = subprocess.run(["pgrep", "-f", f"heron.engine.core_proc .* {process.pid}$"], capture_output=True,
                               text=True)
        stderr_file.seek(0)
        stderr = stderr_file.read()
    assert cores.stdout == "", stderr[-3000:]
    return process.returncode, stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_the_app_is_built_stops_it_gracefully(signum):
    returncode, stderr = _run_until_it_stops(SCRIPT, signum)
    assert returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr[-3000:]
    assert "heron is ready" not in stderr  # it stopped before it served


@pytest.mark.parametrize("script", [SCRIPT_BETWEEN_RANKS, SCRIPT_IN_IMPORTS], ids=["between-ranks", "in-imports"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_early_in_a_start_takes_the_engine_cores_with_it(script, signum):
    returncode, stderr = _run_until_it_stops(script, signum)
    assert returncode == (130 if signum == signal.SIGINT else 0), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
