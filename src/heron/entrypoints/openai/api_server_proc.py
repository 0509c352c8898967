"""One API-server process of ``heron serve --api-server-count M``, started by
``api_server_pool.py``: ``python -m heron.entrypoints.openai.api_server_proc START_PICKLE
LAUNCHER_PID`` (it exits when its launcher is gone: ``launcher_watch.py``).

It resolves the same flags as the launcher's engine cores (and checks the
engines agree when they report ready), serves the launcher's listening socket
(the first API server) or binds the shared port beside it with
``SO_REUSEPORT`` (the others, which listen once they and the first are ready),
and serves until SIGINT or SIGTERM. It never stops the engine cores: the
launcher owns them."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import sys

from heron.engine.args import EngineArgs
from heron.entrypoints.cli import configure_logging
from heron.entrypoints.openai.api_server_pool import METRICS_DIR_ENV, USAGE_ERROR
from heron.entrypoints.openai.listen_socket import bind_shared_port
from heron.entrypoints.openai.server import APIServerRole, StartLoadError, gateway_settings_from_args, serve_api
from heron.entrypoints.openai.shared_gateway import SharedGatewayState
from heron.launcher_watch import exit_when_launcher_gone


def main(start_path: str, launcher_pid: int) -> int:
    exit_when_launcher_gone(launcher_pid, what="API server")
    with open(start_path, "rb") as start_file:
        args, port, index, endpoints, shared_path, inherited_fd = pickle.load(start_file)
    os.unlink(start_path)
    configure_logging(args.log_level)
    args.port = port
    try:  # (the launcher of several API servers leaves resolving the flags and the model's header to them)
        config = EngineArgs.from_cli_args(args, usage="serve").create_engine_config()
    except (ValueError, FileNotFoundError) as exc:  # a damaged GGUF, a bad flag: as ``heron serve`` says it
        print(f"heron: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    shared = SharedGatewayState(shared_path, index)
    if inherited_fd is not None:  # the launcher's reserved socket, listening already
        listen_socket = socket.socket(fileno=inherited_fd)
    else:
        listen_socket = bind_shared_port(args.host, port)
    role = APIServerRole(index, shared.num_servers, shared)
    try:
        return asyncio.run(serve_api(args, config, gateway_settings_from_args(args), endpoints, role,
                                     listener=listen_socket))
    except KeyboardInterrupt:
        return 0
    except StartLoadError as exc:  # said as ``heron serve`` says it (any other error keeps its traceback)
        print(f"heron: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    finally:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid(), os.environ[METRICS_DIR_ENV])
        listen_socket.close()
        shared.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
