"""``POST /reset_prefix_cache`` on the router: every replica forgets its cached
prefixes, as each one's own endpoint does (heron's and vLLM's).

The request goes to every replica the router knows (decode and prefill, in
rotation or not: a replica out of rotation may still hold prefixes) at once,
with the client's own ``Authorization`` (a replica's key guards its endpoint;
the router's ``--replica-api-key`` is never lent to a client). The answer
names each replica's outcome: 200 when every one reset, 409 when some were
busy (``prefix_cache_in_use``: they forgot nothing, the others did), 502 when
some could not be reached or refused. The router's own index follows the
replicas' KV events (their "all blocks cleared")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from heron.router.response_writer import error_body

RESET_PATH = "/reset_prefix_cache"
_TIMEOUT_S = 30.0  # a reset waits for no request; one that takes this long is not answering


async def reset_every_replica(session: aiohttp.ClientSession, urls: Sequence[str],
                              client_headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """The status and body to answer: each replica's status and answer under
    ``replicas``. ``client_headers``: the request's (lower-case names); only its
    ``authorization`` is passed on."""
    key = {"Authorization": client_headers["authorization"]} if "authorization" in client_headers else {}
    results = await asyncio.gather(*(_reset_one(session, url, key) for url in urls))
    replicas = dict(zip(urls, results, strict=True))
    statuses = [result["status"] for result in results]
    if statuses and all(status == 200 for status in statuses):
        return 200, {"reset": True, "replicas": replicas}
    if not statuses:
        return 503, {**error_body(503, "no replica to reset", "no_replica"), "replicas": replicas}
    if 409 in statuses and all(status in (200, 409) for status in statuses):
        busy = sum(status == 409 for status in statuses)
        return 409, {**error_body(409, f"{busy} of {len(statuses)} replicas were serving requests and forgot "
                                       "nothing (the others reset)", "prefix_cache_in_use"), "replicas": replicas}
    failed = sum(status != 200 for status in statuses)
    return 502, {**error_body(502, f"{failed} of {len(statuses)} replicas did not reset (see replicas)",
                              "replica_error"), "replicas": replicas}


async def _reset_one(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> dict[str, Any]:
    """One replica's outcome: its status (None: unreachable) and its answer."""
    try:
        async with session.post(f"{url}{RESET_PATH}", headers=dict(headers),
                                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as response:
            raw = await response.read()
            try:
                answer: Any = json.loads(raw)
            except ValueError:
                answer = raw.decode("utf-8", "replace")[:300]
            return {"status": response.status, "answer": answer}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": None, "answer": f"unreachable: {type(exc).__name__}: {exc}"[:300]}
