"""The ``heron`` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

from heron.engine.args import EngineArgs
from heron.entrypoints.sampling_args import add_sampling_args

if TYPE_CHECKING:
    from heron.engine.core_client import OwnedEngineCore


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heron", description="heron: LLM inference engine and OpenAI-compatible server"
    )
    parser.add_argument("--log-level", default="INFO", **LOG_LEVEL)
    subcommands = parser.add_subparsers(dest="command", required=True)

    generate = subcommands.add_parser("generate", help="complete one prompt, streaming the text")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(generate)
    add_sampling_args(generate)

    chat = subcommands.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat, max_tokens=512)

    from heron.entrypoints.openai.cli_args import add_serve_args

    serve = subcommands.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(serve)
    add_serve_args(serve)

    convert = subcommands.add_parser("convert", help="write a model (e.g. a GGUF file) as a Hugging Face directory")
    convert.add_argument("--output", required=True, help="directory to write")
    EngineArgs.add_cli_args(convert)

    from heron.entrypoints.bench_cli import add_bench_parsers
    from heron.entrypoints.router_cli import add_router_parser

    add_bench_parsers(subcommands)
    add_router_parser(subcommands)
    _add_log_level_to_subcommands(parser)
    return parser


LOG_LEVEL: dict = {"type": str.upper, "choices": ["DEBUG", "INFO", "WARNING", "ERROR"],
                   "help": "how much heron logs (any case)"}


def _add_log_level_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` after the subcommand too (``heron serve --log-level
    DEBUG``, as vLLM takes it), at every depth; given there, it wins over one
    given before (the default leaves the top level's value alone)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.add_argument("--log-level", default=argparse.SUPPRESS, **LOG_LEVEL)
                _add_log_level_to_subcommands(subparser)


class _Terminated(Exception):
    """SIGTERM while ``heron serve`` starts, before the server's own handler (a graceful stop) is installed."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    try:
        # the parser imports the serve, bench and router options' modules (a second or two): a Ctrl-C
        # then printed a KeyboardInterrupt traceback from deep inside an import
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return 130
    configure_logging(args.log_level)
    try:
        if args.command in ("generate", "chat"):
            from heron.entrypoints.terminal import run_chat, run_generate

            return run_generate(args) if args.command == "generate" else run_chat(args)
        if args.command == "serve":
            # until the server installs its own: SIGTERM's default action killed the starting server outright
            # (exit -15, its private directories left for the next heron; its engine cores leave on their own)
            signal.signal(signal.SIGTERM, _terminate)
            from heron.engine.dp_client import start_engine_cores
            from heron.entrypoints.openai.cli_args import check_serve_args
            from heron.entrypoints.openai.listen_socket import open_listener

            check_serve_args(args)
            # the port before the model: one in use fails at once, not once the model has loaded
            listener = open_listener(args.host, args.port, args.api_server_count)
            args.port = listener.getsockname()[1]  # --port 0: the port it got
            started: list[OwnedEngineCore] = []
            try:
                # first: the engine cores load the model while this process starts the server
                started = start_engine_cores(EngineArgs.from_cli_args(args, usage="serve"), args.log_level,
                                             num_clients=args.api_server_count)
                from heron.entrypoints.openai.server import run_server
            except BaseException:  # a Ctrl-C in the server's imports too: no engine core outlives heron
                listener.close()
                for core in started:
                    core.kill()
                raise
            return run_server(args, started, listener)
        if args.command == "convert":
            from heron.entrypoints.convert import check_output_directory, export_hf_directory

            check_output_directory(args.output)  # before the model loads
            if getattr(args, "quantization", None) not in (None, "auto", "none"):  # it wrote float32 regardless
                raise ValueError(f"heron convert writes float weights; --quantization {args.quantization} applies "
                                 "when the directory is served (heron serve --model DIR --quantization "
                                 f"{args.quantization})")
            if args.dtype == "auto":  # "auto" is the fastest dtype here (bfloat16 on some CPUs): lossy for a copy
                args.dtype = "float32"
            print(export_hf_directory(EngineArgs.from_cli_args(args).create_engine_config(), args.output))
            return 0
        if args.command == "router":
            from heron.entrypoints.router_cli import run_router

            return run_router(args)
        if args.command == "bench":
            from heron.entrypoints.bench_cli import run_bench

            return run_bench(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"heron: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except _Terminated:  # asked to stop while starting: a clean stop, as once serving
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
