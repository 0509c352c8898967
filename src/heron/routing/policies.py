"""Routing policies: which replica gets a request.

* ``kv_aware`` (default): cost = ``cache_weight`` x the prompt's blocks the
  replica does not hold (the longest run of leading blocks it holds counts as
  cached) + the replica's load, both in blocks of prefill work: a replica's
  load is the uncached prompt blocks of the requests under way there, plus one
  block per request and a penalty as its KV pool fills. The cheapest wins.
  While the load spread between the usable replicas exceeds
  ``imbalance_threshold`` blocks, the least-loaded replica wins instead (its
  best cache match breaks ties): affinity never piles everything on one
  replica.
* ``least_load``: the least-loaded replica.
* ``round_robin``: each usable replica in turn.
* ``session``: a conversation (``user`` field or ``X-Session-Id`` header) stays
  on its replica while that replica is usable; a new or orphaned one is placed
  by ``kv_aware`` and pinned there.

Load is counted the moment the router sends a request (``ReplicaLoad.dispatch``),
not when the replica next reports, so a burst spreads at once; the request's
blocks are expected in that replica's index at once too (``KVBlockIndex.expect``),
so its followers find them before the replica's events confirm them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from heron.core.hashing import BlockHash

RoutingPolicy = Literal["kv_aware", "least_load", "round_robin", "session"]


@dataclass
class ReplicaLoad:
    in_flight: int = 0  # requests this router sent that have not finished
    pending_blocks: int = 0  # their uncached prompt blocks: prefill work queued there
    reported_running: int = 0  # from the replica's own metrics, when last read
    reported_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    # the requests it runs at once (its max_num_seqs) where known (the engines of one server's data
    # parallelism): past it, a request waits for another to end
    capacity: int | None = None

    def score(self, kv_usage_weight: float = 16.0, queue_weight: float = 16.0) -> float:
        """Work ahead of a new request, in blocks: the prefill queued by this
        router, one block per request (decoding) whoever sent it, a penalty as
        the KV pool fills up (a full pool preempts), and, where ``capacity`` is
        known, ``queue_weight`` blocks per request past it: a request that waits
        for a slot waits for a whole answer, which a cached prefix does not buy
        back (with one block a request, a long shared system prompt kept every
        request on one engine, 12 waiting, while the other engine idled)."""
        requests = max(self.in_flight, self.reported_running + self.reported_waiting)
        queued = max(0, requests - self.capacity) if self.capacity is not None else 0
        return self.pending_blocks + requests + queue_weight * queued + kv_usage_weight * self.kv_cache_usage

    def dispatch(self, uncached_blocks: int) -> None:
        self.in_flight += 1
        self.pending_blocks += uncached_blocks

    def release(self, uncached_blocks: int) -> None:
        self.in_flight -= 1
        self.pending_blocks -= uncached_blocks


class Candidate(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def load(self) -> ReplicaLoad: ...

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int: ...


@dataclass
class RoutingDecision:
    replica: Candidate
    matched_blocks: int
    reason: str
    num_blocks: int = 0  # the prompt's full blocks

    @property
    def uncached_blocks(self) -> int:
        """Prefill work the request brings, in blocks (its partial tail counts as one)."""
        return self.num_blocks - self.matched_blocks + 1


@dataclass
class Router:
    """Picks among the usable candidates it is given (health is the caller's)."""

    policy: RoutingPolicy = "kv_aware"
    # an uncached block costs its request the time to compute it and costs the
    # replica that compute, which every other request there waits for too
    cache_weight: float = 2.0
    imbalance_threshold: float = 64.0
    max_sessions: int = 100_000
    _turn: itertools.count = field(default_factory=itertools.count)
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def with_own_state(self) -> Router:
        """A router of the same settings with a turn and sessions of its own, for
        another set of replicas (the prefill stage's): sharing them, each request
        took two turns, so round robin sent every request to the same one of two
        decode replicas, and a session's replica alternated between the stages'."""
        return Router(self.policy, self.cache_weight, self.imbalance_threshold, self.max_sessions)

    def choose(
        self, candidates: Sequence[Candidate], block_hashes: Sequence[BlockHash], session: str | None = None
    ) -> RoutingDecision:
        decision = self._choose(candidates, block_hashes, session)
        decision.num_blocks = len(block_hashes)
        return decision

    def _choose(
        self, candidates: Sequence[Candidate], block_hashes: Sequence[BlockHash], session: str | None
    ) -> RoutingDecision:
        if not candidates:
            raise LookupError("no replica is available")
        if self.policy == "round_robin":
            replica = candidates[next(self._turn) % len(candidates)]
            return RoutingDecision(replica, replica.matched_blocks(block_hashes), "round_robin")
        if self.policy == "least_load":
            return self._least_loaded(candidates, block_hashes, "least_load")
        if self.policy == "session" and session is not None:
            return self._by_session(candidates, block_hashes, session)
        return self._kv_aware(candidates, block_hashes)

    def _kv_aware(self, candidates: Sequence[Candidate], block_hashes: Sequence[BlockHash]) -> RoutingDecision:
        scores = [candidate.load.score() for candidate in candidates]
        if max(scores) - min(scores) > self.imbalance_threshold:
            return self._least_loaded(candidates, block_hashes, "imbalance")
        best: RoutingDecision | None = None
        best_cost = float("inf")
        for candidate, load in zip(candidates, scores):
            matched = candidate.matched_blocks(block_hashes)
            cost = self.cache_weight * (len(block_hashes) - matched) + load
            if cost < best_cost:
                best, best_cost = RoutingDecision(candidate, matched, "kv_aware"), cost
        assert best is not None
        return best

    @staticmethod
    def _least_loaded(
        candidates: Sequence[Candidate], block_hashes: Sequence[BlockHash], reason: str
    ) -> RoutingDecision:
        matched = [candidate.matched_blocks(block_hashes) for candidate in candidates]
        index = min(range(len(candidates)), key=lambda i: (candidates[i].load.score(), -matched[i]))
        return RoutingDecision(candidates[index], matched[index], reason)

    def _by_session(
        self, candidates: Sequence[Candidate], block_hashes: Sequence[BlockHash], session: str
    ) -> RoutingDecision:
        pinned = self._sessions.get(session)
        for candidate in candidates:
            if candidate.name == pinned:
                self._sessions.move_to_end(session)
                return RoutingDecision(candidate, candidate.matched_blocks(block_hashes), "session")
        decision = self._kv_aware(candidates, block_hashes)
        self._sessions[session] = decision.replica.name
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return decision
