"""``heron router --prefill URL --decode URL``: prefill/decode disaggregation.

Each generation request goes first to a prefill replica, as a one-token,
non-streamed request that asks it to keep the prompt's KV
(``kv_transfer_params: {"do_remote_decode": true}``); the replica answers with
the ``kv_transfer_params`` a decode engine needs to pull that KV. The client's
request then goes to a decode replica with those parameters added, and its
answer (streamed or not) is the client's. When no prefill replica can serve
the prompt (down, overloaded, an error), the decode replica computes it itself:
disaggregation is an optimisation, never a new way to fail.

Only completion and chat requests of one prompt and one sample go through the
prefill stage (``prefills_first``): a decode server pulls the KV of one prompt
for one sequence, and the Responses API has no one-token form of its request.
Every other request goes to a decode replica unchanged. The prefill copy keeps
nothing that ties the output's length or form (``min_tokens``, streaming) to
what the client asked: it asks for exactly one token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from heron.router.prompt_hashes import CHAT_PATH
from heron.router.replica import Replica, ReplicaSet, TakenOut, unless_taken_out
from heron.routing.policies import Router

logger = logging.getLogger(__name__)

PREFILL_PATHS = ("/v1/completions", CHAT_PATH)
# dropped from the prefill copy: one non-streamed sample of one token, whatever the client asked
# a client's own handle would have the decode replica connect wherever it names: the router's to write
CLIENT_KV_TRANSFER = ("this router runs prefill/decode disaggregation (--prefill) and writes kv_transfer_params "
                      "itself: send the request without them")
_NOT_PREFILLED = ("stream", "stream_options", "n", "best_of", "min_tokens", "kv_transfer_params")


def prefills_first(path: str, body: dict[str, Any]) -> bool:
    """Whether a generation request goes to a prefill replica first: a completion
    or chat request of one prompt and one sample (``n``, ``best_of``: absent or
    1); the router refuses one that names ``kv_transfer_params`` of its own
    (``CLIENT_KV_TRANSFER``), and null is none."""
    if path not in PREFILL_PATHS or body.get("kv_transfer_params") is not None:
        return False
    if any(body.get(key) not in (None, 1) for key in ("n", "best_of")):
        return False
    prompt = body.get("prompt")
    several_prompts = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))
    return not several_prompts


def block_sizes_match(first: int | None, second: int | None) -> bool:
    """Whether blocks of these sizes can be pulled one into the other (a size
    not named, as by a replica whose /health names none, matches any)."""
    return first is None or second is None or first == second


def same_block_size(prefill: Replica, decodes: Sequence[Replica]) -> bool:
    """Whether one of ``decodes`` can pull what ``prefill`` stores."""
    return prefill.block_size is None or any(block_sizes_match(prefill.block_size, d.block_size) for d in decodes)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The copy of a client's request sent to a prefill replica: one token, not
    streamed, one sample, with no lower bound on its length."""
    request = {key: value for key, value in body.items() if key not in _NOT_PREFILLED}
    request.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


class PrefillStage:
    def __init__(self, replicas: ReplicaSet, router: Router, registry: CollectorRegistry,
                 timeout_s: float = 600.0) -> None:
        """``timeout_s``: the longest a prefill replica may take (then it counts as
        failed and the decode replica computes the prompt): a prefill is an
        optimisation, and a hung prefill replica must not hold requests for
        ever when the router has no ``--request-timeout``."""
        self.replicas = replicas
        self.router = router
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=2.0)
        self._warned_block_sizes: set[str] = set()
        self.outcomes = Counter("heron_router_prefills", "Prompts sent to a prefill replica first, by outcome",
                                ["outcome"], registry=registry)
        self.seconds = Histogram("heron_router_prefill_seconds", "Time a prefill replica took",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)

    async def run(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any], headers: dict[str, str],
                  hashes: list[bytes], decodes: Sequence[Replica], deadline: float | None = None,
                  ) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of the prompt prefilled on a prefill replica
        (None: none could, or ``deadline``, the loop's time, passed: the decode
        replica will compute it). A replica is used only when its breaker allows
        it (half-open: one trial at a time), as for decode replicas, and when one
        of ``decodes`` (the usable decode replicas that pull KV) can pull its
        blocks: one of another block size prefilled for nothing."""
        unpullable = [replica for replica in self.replicas.usable() if not same_block_size(replica, decodes)]
        replica = self._choose(hashes, unpullable)
        if replica is None:
            self.outcomes.labels("block_size_mismatch" if unpullable and not self.replicas.usable(unpullable)
                                 else "no_replica").inc()
            self._warn_unpullable(unpullable, decodes)
            return None
        started = time.perf_counter()
        answered, result = await self._prefill(session, replica, path, body, headers, hashes, deadline)
        self.seconds.observe(time.perf_counter() - started)
        # a prompt of no whole block is answered with nothing to transfer: not a failure of the replica
        self.outcomes.labels("ok" if result is not None else "nothing_to_transfer" if answered else "failed").inc()
        return result

    def _warn_unpullable(self, unpullable: list[Replica], decodes: Sequence[Replica]) -> None:
        """Says once per prefill replica that no decode replica pulls its blocks."""
        for replica in unpullable:
            if replica.url not in self._warned_block_sizes:
                self._warned_block_sizes.add(replica.url)
                logger.warning("prefill replica %s stores KV in blocks of %s tokens and the decode replicas in %s: "
                               "none can pull its blocks, so it is skipped (start every replica with the same "
                               "--block-size)", replica.url, replica.block_size,
                               sorted({decode.block_size for decode in decodes if decode.block_size is not None}))

    def _choose(self, hashes: list[bytes], exclude: list[Replica]) -> Replica | None:
        """The policy's pick among the usable replicas not in ``exclude`` whose
        breaker lets a request through."""
        tried = list(exclude)
        while candidates := self.replicas.usable(exclude=tried):
            replica = self.router.choose(candidates, hashes, None).replica
            assert isinstance(replica, Replica)
            if replica.breaker.allows():
                return replica
            tried.append(replica)
        return None

    async def _prefill(self, session: aiohttp.ClientSession, replica: Replica, path: str, body: dict[str, Any],
                       headers: dict[str, str], hashes: list[bytes], deadline: float | None,
                       ) -> tuple[bool, dict[str, Any] | None]:
        """Whether the replica answered 200, and its ``kv_transfer_params`` for the prompt;
        None when it fails, refuses, misses ``deadline`` or is taken out (its breaker opens: a
        hung host held the request for the whole prefill timeout, though the decode replica
        could compute the prompt), or has none to give (a prompt of no whole block)."""
        replica.load.dispatch(len(hashes))
        replica.index.expect(hashes)
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                status, answer = await unless_taken_out(
                    replica, self._post(session, replica.url + path, prefill_request(body), headers))
            self.replicas.record(replica, status)
            if status != 200:
                logger.info("prefill replica %s answered %d: the decode replica computes the prompt",
                            replica.url, status)
                return False, None
        except TakenOut as exc:
            logger.warning("prefill replica %s: %s; the decode replica computes the prompt", replica.url, exc)
            return False, None
        except TimeoutError as exc:
            if scope.expired():  # the request's deadline, not the replica's failure
                logger.warning("prefill replica %s had not answered by the request's deadline", replica.url)
            else:
                logger.warning("prefill replica %s failed: %r", replica.url, exc)
                self.replicas.record(replica, None)
            return False, None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            logger.warning("prefill replica %s failed: %r", replica.url, exc)
            self.replicas.record(replica, None)
            return False, None
        finally:
            replica.load.release(len(hashes))
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return True, params if isinstance(params, dict) else None

    async def _post(self, session: aiohttp.ClientSession, url: str, request: dict[str, Any],
                    headers: dict[str, str]) -> tuple[int, Any]:
        """The status and (for a 200) the JSON answer of a prefill request."""
        async with session.post(url, json=request, headers=headers, timeout=self.timeout) as response:
            return response.status, await response.json() if response.status == 200 else None
