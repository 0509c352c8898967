"""Flags of ``heron serve``."""

from __future__ import annotations

import argparse
import os

from heron import envs
from heron.engine.args import positive_size
from heron.engine.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S
from heron.entrypoints.arg_types import (
    FINITE_POSITIVE_FLOAT,
    NON_NEGATIVE_FLOAT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    add_keep_alive_timeout,
    number_at_least,
    port,
)
from heron.entrypoints.openai.cors import add_cors_args, cors_settings_from_args
from heron.entrypoints.openai.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_REQUEST_BODY_BYTES
from heron.entrypoints.openai.tools.parsers import PARSERS as TOOL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=port, default=8000)
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    group.add_argument("--log-stats-interval", type=FINITE_POSITIVE_FLOAT, default=10.0,
                       help="seconds between engine stats log lines")
    group.add_argument("--log-requests", action="store_true",
                       help="log each request's prompt and sampling parameters, and its output text when it finishes "
                            "(INFO); without it no prompt or output is logged")
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="the Jinja chat template for chat requests (a file, or the template itself), instead of "
                            "the model's; one that takes `tools` renders tool definitions and calls itself")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format the model writes tool calls in (default: the chat template's, hermes for a "
                            "template without tools, which heron teaches the model through the system message)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in chat requests (a Jinja template the server renders: sandboxed, "
                            "but its loops run on the server's CPU); without it such requests get 400")
    group.add_argument("--api-server-count", type=POSITIVE_INT, default=1,
                       help="API-server processes sharing the port (SO_REUSEPORT), each talking to every engine core")
    group.add_argument("--dead-engine-grace", type=NON_NEGATIVE_FLOAT, default=5.0, metavar="SECONDS",
                       help="when the engine core dies: seconds the server goes on answering 503 (so clients and "
                            "load balancers see it) before it exits with code 1, for a supervisor to restart it")
    group.add_argument("--engine-heartbeat-timeout", type=NON_NEGATIVE_FLOAT, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                       metavar="SECONDS",
                       help="an engine core that sends nothing for this long (its process stopped or hung; it sends "
                            "a heartbeat every second) counts as dead, as one that exited does; 0 never")
    group.add_argument("--engine-step-timeout", type=NON_NEGATIVE_FLOAT, default=0.0, metavar="SECONDS",
                       help="an engine core whose one step runs this long (stuck in a kernel or a collective) counts "
                            "as dead; 0 (the default) never: a step on a big model on a CPU can take minutes")
    group.add_argument("--shutdown-timeout", type=NON_NEGATIVE_FLOAT, default=5.0, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C: seconds the requests under way get to finish (new connections "
                            "are refused meanwhile) before the rest are cut; 0 cuts them at once. A supervisor's "
                            "kill timeout (Kubernetes' terminationGracePeriodSeconds) should exceed it")
    add_keep_alive_timeout(group)
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument("--api-key", action="append", default=None,
                         help="accepted API key (repeatable; also HERON_API_KEY, comma separated)")
    gateway.add_argument("--api-key-file", default=None, help="file with one accepted API key per line")
    gateway.add_argument("--protect-metrics", action="store_true",
                         help="require the API key on every route but the chat page (/): /metrics, /health and "
                              "/version too (needs an API key)")
    gateway.add_argument("--rate-limit", type=POSITIVE_FLOAT, default=None,
                         help="requests per second allowed per API key")
    gateway.add_argument(
        "--rate-limit-burst", type=number_at_least(float, 1), default=None,
        help="burst size (default: 2x the rate, at least 1)"
    )
    gateway.add_argument(
        "--forwarded-allow-ips", default=None, metavar="IPS",
        help="trust X-Forwarded-For / X-Forwarded-Proto from these proxy addresses (comma separated) for the "
             "client's address (the rate limit's key without API keys); by default the headers are ignored: any "
             "client on this host could name itself anyone and pass the limit. '*' trusts every sender, so any "
             "client that reaches the port directly names itself: name the proxies instead",
    )
    gateway.add_argument("--max-waiting-requests", type=POSITIVE_INT, default=None,
                         help="sequences (prompts times n) without a first token beyond which new requests get 429")
    gateway.add_argument("--request-timeout", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                         help="seconds before a request is aborted (default: never)")
    gateway.add_argument("--stream-stall-timeout", type=NON_NEGATIVE_FLOAT, default=60.0, metavar="SECONDS",
                         help="end a stream (abort its request, close the connection) whose client has taken no "
                              "bytes for this long while the server had some to send; 0 disables")
    gateway.add_argument("--max-request-body-bytes", type=positive_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                         help="largest accepted request body (413 past it)")
    gateway.add_argument("--max-header-bytes", type=positive_size, default=DEFAULT_MAX_HEADER_BYTES,
                         help="most bytes of request header names and values (431 past it)")
    add_cors_args(gateway)


def collect_api_keys(cli_keys: list[str] | None, key_file: str | None) -> list[str]:
    """Keys from --api-key (repeatable), the HERON_API_KEY variable (comma
    separated) and --api-key-file (one per line, # comments). A source given
    that names no key is an error: the server it started took every request
    without one, saying nothing."""
    keys = list(cli_keys or [])
    from_env = envs.api_keys()
    if os.environ.get(envs.HERON_API_KEY, "").strip() and not from_env:
        raise ValueError(f"{envs.HERON_API_KEY} is set but names no key (only commas?)")
    keys += from_env
    if key_file:
        with open(key_file, encoding="utf-8") as handle:
            lines = [line.strip() for line in handle]
        from_file = [line for line in lines if line and not line.startswith("#")]  # an indented comment is one too
        if not from_file:
            raise ValueError(f"--api-key-file {key_file!r} holds no key (only empty lines or # comments)")
        keys += from_file
    for key in keys:
        if not key or key != key.strip():
            # `--api-key "$UNSET"` turned keys on with "", which the empty bearer token matched
            raise ValueError("an API key must not be empty nor begin or end with whitespace (an unset "
                             "variable given to --api-key?)")
        if not key.isascii() or not key.isprintable():
            # HTTP headers carry bytes a client may encode any way: such a key could never match
            raise ValueError("an API key must be printable ASCII (a key with other characters can never match "
                             "the Authorization header a client sends)")
    return list(dict.fromkeys(keys))


def check_gateway(api_keys: list[str], protect_metrics: bool) -> None:
    """Refuse a gateway that would protect nothing it was asked to."""
    if protect_metrics and not api_keys:
        raise ValueError("--protect-metrics needs an API key: give --api-key, HERON_API_KEY or --api-key-file")


def check_serve_args(args: argparse.Namespace) -> None:
    """The gateway flags' checks, before ``heron serve`` starts anything (the
    engine cores start before the server reads its flags). The keys are read
    here, once, and ``args`` carries them on: a key file that reads once (a
    pipe: ``--api-key-file <(vault read ...)``, /dev/stdin) was read again by
    the server, which then had no key and took every request."""
    keys = collect_api_keys(args.api_key, args.api_key_file)
    args.api_key, args.api_key_file = keys, None
    check_gateway(keys, args.protect_metrics)
    cors_settings_from_args(args)
    read_chat_template(args.chat_template)
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):  # it was "[Errno 2] No such file", naming none
            raise ValueError(f"{flag} {path!r}: no such file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):  # uvicorn's bare AssertionError, after start
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: TLS needs the key and its certificate")
    if args.port == 0 and args.data_parallel_backend == "ray":  # it registered http://HOST:0, which no router reaches
        raise ValueError("--port 0 (any free port) cannot be registered on the Ray cluster for routers to find: "
                         "give the port with --data-parallel-backend ray")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            return handle.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
