"""Waiting on a replica's answer: its end, its cut, the request's deadline,
or (its replica taken out) a stall; and a failure answer read whole."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass

from heron.router.replica import Replica, TakenOut, unless_taken_out
from heron.router.upstream import UpstreamConnection, UpstreamCut
from heron.routing.health import BreakerState


@dataclass(frozen=True, slots=True)
class Refusal:
    """A replica's failure answer (500/502/503), read whole: the client's if no replica serves."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


KEPT_REFUSAL_BYTES = 64 << 10  # of a failure answer's body (an error object is far smaller)


async def read_kept(connection: UpstreamConnection, deadline: float | None) -> tuple[Outcome, bytes]:
    """An answer's body, its first ``KEPT_REFUSAL_BYTES``, and how waiting for its end went."""
    body = bytearray()
    connection.stream_to(lambda chunk: body.extend(chunk[:KEPT_REFUSAL_BYTES - len(body)]))
    return await until(connection.done, deadline), bytes(body)


class Outcome(enum.Enum):
    DONE = "done"
    CUT = "cut"  # the replica's answer stopped before its end
    DEADLINE = "deadline"  # the request's deadline passed first
    STALLED = "stalled"  # its replica was taken out, and it had no byte for STALL_S


# an answer whose replica the router took out ends once it has had no byte for this long
STALL_S = 2.0
_OUT_CHECK_S = 0.25  # how often a relay whose replica is out looks whether it is back


async def until(done: asyncio.Future[None], deadline: float | None) -> Outcome:
    """Waits for an answer's end, its cut, or the deadline (None: none)."""
    try:
        async with asyncio.timeout_at(deadline):
            await done
    except UpstreamCut:
        return Outcome.CUT
    except TimeoutError:
        return Outcome.DEADLINE
    return Outcome.DONE


async def until_or_stalled(replica: Replica, done: asyncio.Future[None], deadline: float | None,
                            idle_s: Callable[[], float]) -> Outcome:
    """``until``, except that while ``replica`` is taken out (its breaker open)
    the answer ends as STALLED once it has had no byte for ``STALL_S``
    (``idle_s``: how long it has had none). A stopped replica's stream never
    ended, though the router had taken the replica out; one still sending goes
    on, and once the replica is back in use (its breaker no longer open) a pause
    is no stall again."""
    ending = asyncio.ensure_future(until(done, deadline))
    try:
        while True:
            try:
                return await unless_taken_out(replica, asyncio.shield(ending))
            except TakenOut:
                pass
            while replica.breaker.state is BreakerState.OPEN:
                idle = idle_s()
                if idle >= STALL_S:
                    return Outcome.STALLED
                finished, _ = await asyncio.wait({ending}, timeout=min(STALL_S - idle, _OUT_CHECK_S))
                if finished:
                    return ending.result()
    finally:
        ending.cancel()
