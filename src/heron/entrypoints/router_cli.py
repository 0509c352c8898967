"""``heron router``: flags and start-up of the KV-aware router (``heron/router``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, get_args

from heron.entrypoints.arg_types import (
    FINITE_NON_NEGATIVE_FLOAT,
    FINITE_POSITIVE_FLOAT,
    POSITIVE_INT,
    add_keep_alive_timeout,
    port,
)
from heron.entrypoints.openai.cors import origin_list
from heron.http_bounds import ConnectionBounds
from heron.routing.policies import RoutingPolicy

logger = logging.getLogger(__name__)


def add_router_parser(subcommands: Any) -> None:
    router = subcommands.add_parser("router", help="OpenAI-compatible router over heron replicas (KV-cache aware)")
    router.add_argument("--replica", "--decode", action="append", default=[], metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each); with --prefill, "
                             "the decode replicas")
    router.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="prefill/decode disaggregation: a prefill replica (repeat for each; started with "
                             "--kv-transfer-config kv_producer), to which every prompt goes first")
    router.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="also route to the heron servers registered on this Ray cluster (those started with "
                             "--data-parallel-backend ray), as they come and go; 'auto': this machine's cluster")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=port, default=8080)
    router.add_argument("--policy", default="kv_aware", choices=list(get_args(RoutingPolicy)))
    router.add_argument("--model", default=None,
                        help="the replicas' model, for its tokenizer and chat template (default: the embedded one)")
    router.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    router.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template the replicas were started with (their --chat-template), so the "
                             "router renders chats as they do (else no chat prompt's blocks match theirs)")
    router.add_argument("--replica-api-key", default=None,
                        help="key for the replicas' /metrics and /v1/kv_events (clients send their own)")
    router.add_argument("--cache-weight", type=FINITE_NON_NEGATIVE_FLOAT, default=2.0,
                        help="kv_aware: cost of one uncached prompt block against one block of queued prefill")
    router.add_argument("--imbalance-threshold", type=FINITE_NON_NEGATIVE_FLOAT, default=64.0,
                        help="kv_aware: load spread (in blocks of queued work) beyond which the least-loaded "
                             "replica wins")
    router.add_argument("--probe-interval", type=FINITE_POSITIVE_FLOAT, default=1.0,
                        help="seconds between health probes")
    router.add_argument("--probe-timeout", type=FINITE_POSITIVE_FLOAT, default=2.0, metavar="SECONDS",
                        help="seconds a replica has to answer a probe before it counts as a failure (a replica's "
                             "API server answers only once it has started, which takes longer with "
                             "--api-server-count or on a busy machine)")
    router.add_argument("--max-attempts", type=POSITIVE_INT, default=3, help="replicas tried before a request fails")
    router.add_argument("--request-timeout", type=FINITE_NON_NEGATIVE_FLOAT, default=0.0, metavar="SECONDS",
                        help="longest time a request may take, from its arrival to its answer's end (0, the "
                             "default: no limit); past it the client gets 504, or an error event ending its "
                             "stream, and the request is not retried elsewhere")
    router.add_argument("--shutdown-timeout", type=FINITE_NON_NEGATIVE_FLOAT, default=5.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C: seconds the requests under way get to finish (new connections "
                             "are refused meanwhile) before the rest are cut; 0 cuts them at once")
    router.add_argument("--allowed-origins", type=origin_list, action="extend", default=None, metavar="ORIGINS",
                        help="browser pages from these origins (comma separated or a JSON list; '*' for any) may "
                             "read the router's own answers, its errors (503, 504, 404...); the replicas' answers, "
                             "preflights included, carry the replicas' own CORS headers (their --allowed-origins)")
    add_keep_alive_timeout(router)


def run_router(args: argparse.Namespace) -> int:
    from heron.router.prompt_hashes import PromptHasher
    from heron.router.replica import ReplicaSet
    from heron.router.server import RouterServer
    from heron.routing.policies import Router

    if not args.replica and not args.ray_address:
        raise ValueError("give the replicas: --replica URL (repeatable) and/or --ray-address")
    for url in args.replica + args.prefill:
        _check_replica_url(url)
    headers = {"Authorization": f"Bearer {args.replica_api_key}"} if args.replica_api_key else {}
    replicas = ReplicaSet(args.replica, headers, probe_interval=args.probe_interval, probe_timeout=args.probe_timeout,
                          discover=_ray_discovery(args.ray_address, args.probe_interval) if args.ray_address else None,
                          decodes=bool(args.prefill))
    from heron.entrypoints.openai.cli_args import read_chat_template

    chat_template = read_chat_template(args.chat_template)
    hasher = (PromptHasher(args.model, args.tokenizer, chat_template) if args.policy in ("kv_aware", "session")
              else None)
    router = Router(args.policy, cache_weight=args.cache_weight, imbalance_threshold=args.imbalance_threshold)
    prefill_replicas = (ReplicaSet(args.prefill, headers, probe_interval=args.probe_interval,
                                   probe_timeout=args.probe_timeout, decodes=False) if args.prefill else None)
    server = RouterServer(replicas, router, hasher, max_attempts=args.max_attempts,
                          request_timeout=args.request_timeout or None, prefill_replicas=prefill_replicas,
                          allowed_origins=tuple(args.allowed_origins or ()))
    logger.info("heron router (%s) on http://%s:%d over %s%s", args.policy, args.host, args.port,
                ", ".join(args.replica + ([f"the replicas on Ray at {args.ray_address}"] if args.ray_address else [])),
                f"; prompts prefilled first on {', '.join(args.prefill)}" if args.prefill else "")
    asyncio.run(server.run(args.host, args.port, args.shutdown_timeout,
                           ConnectionBounds(keep_alive_s=args.keep_alive_timeout)))
    return 0


def _check_replica_url(url: str) -> None:
    """A replica URL the router can reach: http(s)://host[:port], else a
    ValueError (a URL without its scheme was taken, and every request got 503
    with nothing said)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
    except ValueError as exc:
        raise ValueError(f"replica URL {url!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica URL {url!r} must be http://HOST[:PORT] or https://HOST[:PORT]")
    path = parts.path.rstrip("/")
    if path.endswith("/v1") or "/v1/" in path or parts.query or parts.fragment:
        # the router adds /v1/... and /health itself: http://host:8000/v1 probed /v1/health, answered 404,
        # and every request was a 503 with only "circuit open" in the log (a prefix a proxy routes by is fine)
        raise ValueError(f"replica URL {url!r} must be the server's root, without /v1 (the router adds /v1/... "
                         f"itself), a query or a fragment: {parts.scheme}://{parts.netloc}{path.partition('/v1')[0]}")


def _ray_discovery(address: str, interval_s: float) -> Callable[[], Awaitable[list[str]]]:
    """Lists the heron servers registered on the Ray cluster, from a child process
    (``router/ray_discovery.py``); an address where no cluster answers fails now."""
    from heron.engine.ray_engines import check_cluster_answers
    from heron.router.ray_discovery import RayDiscovery

    check_cluster_answers(address)
    return RayDiscovery(address, interval_s)
