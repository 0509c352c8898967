"""``heron serve --api-server-count M``: M API-server processes on one port.

When one API server's event loop is the bottleneck (HTTP parsing, SSE framing,
detokenization at high concurrency), more of them share the port. This process
(the launcher) starts the engine cores with M connections each, reserves the
port, and starts M API servers; each binds the port with ``SO_REUSEPORT`` (the
kernel spreads new connections among them) and talks to every engine core.
They share:

* the gateway's limits, through a state file (``shared_gateway.py``);
* their metrics, through prometheus_client's multiprocess directory, so any
  process's /metrics answers for the server.

The launcher reserves the port before anything starts: it checks that no one
holds it (a bind without ``SO_REUSEPORT``: a second server on the port, heron
or not, fails at once instead of sharing its connections), then binds and
listens on it, so no other socket can take it while the API servers start,
and ``--port 0`` resolves to one port for all. That socket is the first API
server's (handed to it as an inherited descriptor, the launcher's copy closed:
once the API servers stop listening, connections are refused, not queued
unanswered); the others bind their own beside it and listen only once they and
the first can serve, so a client never meets one still loading after another
said ready. A connection arriving before the first accepts waits in the socket's
queue rather than being refused. It stops
everything when told to (SIGINT or SIGTERM, passed on to the API servers,
which finish their requests) or when an API server or an engine core dies
(exit code 1: a supervisor such as systemd or Kubernetes starts it again).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from heron.engine.core_client import OwnedEngineCore
from heron.engine.serialization import LOAD_FAILED_EXIT_CODE
from heron.entrypoints.openai.shared_gateway import create_shared_gateway_file
from heron.tempdirs import make_private_dir, remove_private_dir

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# the launcher's word to its API servers that an engine core has ended
ENGINE_GONE_SIGNAL = signal.SIGUSR1
# an API server that could not start for its arguments (a tokenizer that will not load): as ``heron: error``
USAGE_ERROR = 2


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


def run_api_servers(args: argparse.Namespace, started: list[OwnedEngineCore], port_holder: socket.socket) -> int:
    """Start the API servers over the engine cores (``started`` with
    ``args.api_server_count`` connections each), and supervise.
    ``port_holder``: the port, reserved already (``reserve_port``)."""
    count = args.api_server_count
    workdir = make_private_dir("heron-api-")
    servers: list[subprocess.Popen[bytes]] = []
    # both signals stop it, also where SIGINT came in ignored (a background job of a
    # script, `nohup`): Python then leaves it ignored, and `kill -INT` did nothing
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        port = port_holder.getsockname()[1]
        metrics_dir = os.path.join(workdir, "metrics")
        os.mkdir(metrics_dir)
        shared_path = os.path.join(workdir, "gateway")
        create_shared_gateway_file(shared_path, count)
        env = {**os.environ, METRICS_DIR_ENV: metrics_dir}
        # each API server starts with the launcher's word held (a signal mask is inherited): it is delivered
        # once serve_api handles it; before, an engine core ending during start-up killed the API servers
        unmasked = signal.pthread_sigmask(signal.SIG_BLOCK, {ENGINE_GONE_SIGNAL})
        try:
            for index in range(count):
                start_path = os.path.join(workdir, f"api-server-{index}.pickle")
                inherited = (port_holder.fileno(),) if index == 0 else ()  # the first serves the reserved socket
                with open(start_path, "wb") as start_file:
                    pickle.dump((args, port, index, [p.endpoint(index) for p in started], shared_path,
                                 inherited[0] if inherited else None), start_file)
                servers.append(subprocess.Popen(
                    [sys.executable, "-m", "heron.entrypoints.openai.api_server_proc", start_path, str(os.getpid())],
                    env=env, pass_fds=inherited))
                if inherited:  # the first API server holds the port now: once it stops listening, connections
                    port_holder.close()  # are refused (this copy queued them, unanswered, until the launcher exited)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unmasked)
        logger.info("%d API servers on port %d (pids %s) over %d engine core(s)",
                    count, port, ", ".join(str(s.pid) for s in servers), len(started))
        return _supervise(servers, started, args.dead_engine_grace)
    except (_Stop, KeyboardInterrupt):
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_all(servers, started, args.shutdown_timeout)
        port_holder.close()
        remove_private_dir(workdir)


def _supervise(servers: Sequence[subprocess.Popen[bytes]], engines: Sequence[OwnedEngineCore],
               dead_engine_grace: float) -> int:
    """Wait until an API server or an engine core exits: a clean exit of every
    API server (they were told to stop) is 0; an API server dying under the
    others, or an engine core ending, is 1 (2 where the engine core could not
    load the model, by its exit code or by each API server's: a usage error). After an engine core ends, the API
    servers answer 503 for ``dead_engine_grace`` s and exit by themselves; they
    were stopped at once, and clients got refused connections instead."""
    while True:
        ended = next((rank for rank, engine in enumerate(engines) if engine.exit_code() is not None), None)
        if ended is not None:
            # each API server knows whether the core had served (then it answers 503 for the grace): this does not
            logger.error("engine core %d ended (code %s): the API servers stop, after answering 503 for %.1f s "
                         "if it had started serving", ended, engines[ended].exit_code(), dead_engine_grace)
            for server in servers:  # one on Ray cannot see it end (no process of its own to watch): told
                if server.poll() is None:
                    server.send_signal(ENGINE_GONE_SIGNAL)
            deadline = time.monotonic() + dead_engine_grace + 10  # their grace, then time to exit
            while time.monotonic() < deadline and any(server.poll() is None for server in servers):
                time.sleep(0.2)
            said = [server.returncode == USAGE_ERROR for server in servers]
            if engines[ended].exit_code() != LOAD_FAILED_EXIT_CODE and not all(said):
                return 1
            # it could not load the model (a damaged checkpoint): a usage error, which each API server that read
            # the engine core's last word said; where none did, its log holds why
            if not any(said):
                print(f"heron: error: engine core {ended} could not load the model (its log above says why)",
                      file=sys.stderr)
            return USAGE_ERROR
        exited = [server for server in servers if server.poll() is not None]
        if (exited and len(exited) < len(servers)) or any(server.returncode for server in exited):
            culprit = next((server for server in exited if server.returncode), exited[0])
            logger.error("API server (pid %d) exited with code %s: stopping the others",
                         culprit.pid, culprit.returncode)
            return USAGE_ERROR if culprit.returncode == USAGE_ERROR else 1
        if exited:
            return 0
        time.sleep(0.2)


def _stop_all(servers: Sequence[subprocess.Popen[bytes]], engines: Sequence[OwnedEngineCore],
              shutdown_timeout: float) -> None:
    """API servers first (they finish what they serve), then the engine cores.
    SIGTERM, not SIGINT: a terminal's Ctrl-C has already given each API server
    a SIGINT, and uvicorn takes a second one as "exit now", cutting its streams."""
    for server in servers:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + shutdown_timeout + 10  # their own grace, then time to exit
    for server in servers:
        try:
            server.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    # at once, not one after another: a Ray engine core nobody told to stop is waited for, then killed
    stoppers = [threading.Thread(target=engine.stop, name="heron-stop-engine", daemon=True) for engine in engines]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()

