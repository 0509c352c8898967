"""``heron router --prefill URL --decode URL``: prefill/decode disaggregation.

Each generation request goes first to a prefill replica, as a one-token,
non-streamed request that asks it to keep the prompt's KV
(``kv_transfer_params: {"do_remote_decode": true}``); the replica answers with
the ``kv_transfer_params`` a decode engine needs to pull that KV. The client's
request then goes to a decode replica with those parameters added, and its
answer (streamed or not) is the client's. When no prefill replica can serve
the prompt (down, overloaded, an error), the decode replica computes it itself:
disaggregation is an optimisation, never a new way to fail.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from heron.router.replica import Replica, ReplicaSet
from heron.routing.policies import Router

logger = logging.getLogger(__name__)


class PrefillStage:
    def __init__(self, replicas: ReplicaSet, router: Router, registry: CollectorRegistry,
                 timeout_s: float = 600.0) -> None:
        self.replicas = replicas
        self.router = router
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=2.0)
        self.outcomes = Counter("heron_router_prefills", "Prompts sent to a prefill replica first, by outcome",
                                ["outcome"], registry=registry)
        self.seconds = Histogram("heron_router_prefill_seconds", "Time a prefill replica took",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)

    async def run(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any], headers: dict[str, str],
                  hashes: list[bytes]) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of the prompt prefilled on a prefill replica
        (None: none could, the decode replica will compute it)."""
        candidates = self.replicas.usable()
        if not candidates:
            self.outcomes.labels("no_replica").inc()
            return None
        replica = self.router.choose(candidates, hashes, None).replica
        assert isinstance(replica, Replica)
        started = time.perf_counter()
        result = await self._prefill(session, replica, path, body, headers, hashes)
        self.seconds.observe(time.perf_counter() - started)
        self.outcomes.labels("ok" if result is not None else "failed").inc()
        return result

    async def _prefill(self, session: aiohttp.ClientSession, replica: Replica, path: str, body: dict[str, Any],
                       headers: dict[str, str], hashes: list[bytes]) -> dict[str, Any] | None:
        request = {key: value for key, value in body.items() if key not in ("stream", "stream_options", "n")}
        request.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        replica.load.dispatch(len(hashes))
        replica.index.expect(hashes)
        try:
            async with session.post(replica.url + path, json=request, headers=headers,
                                    timeout=self.timeout) as response:
                self.replicas.record(replica, response.status)
                if response.status != 200:
                    logger.info("prefill replica %s answered %d: the decode replica computes the prompt",
                                replica.url, response.status)
                    return None
                answer = await response.json()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            logger.warning("prefill replica %s failed: %s", replica.url, exc)
            self.replicas.record(replica, None)
            return None
        finally:
            replica.load.release(len(hashes))
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None
