"""The router's decisions without processes: the circuit breaker and the policies."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from heron.router.health import BreakerState, CircuitBreaker
from heron.router.kv_index import KVBlockIndex
from heron.router.policies import ReplicaLoad, Router


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_client_errors_never_open_the_breaker():
    breaker = CircuitBreaker(failure_threshold=2)
    for status in (400, 404, 422, 429, 400, 413):
        breaker.record(status)
    assert breaker.state is BreakerState.CLOSED and breaker.allows()


def test_the_breaker_opens_half_opens_for_one_trial_and_closes_on_success():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, open_seconds=2.0, clock=clock)
    breaker.record(None)
    breaker.record(502)
    assert breaker.state is BreakerState.CLOSED  # two failures: still in use
    breaker.record(503)
    assert breaker.state is BreakerState.OPEN and not breaker.allows() and not breaker.usable
    clock.now = 2.5
    assert breaker.usable and breaker.allows()  # the one trial
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.allows()  # no second one meanwhile
    breaker.record(None)  # the trial failed: open for longer
    clock.now = 4.6
    assert not breaker.usable
    clock.now = 6.6
    assert breaker.allows()
    breaker.record(200)
    assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0


@dataclass
class FakeReplica:
    name: str
    blocks: set[bytes] = field(default_factory=set)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)

    def matched_blocks(self, hashes) -> int:
        index = KVBlockIndex(blocks=self.blocks)
        return index.matched_blocks(hashes)


PROMPT = [bytes([i]) * 32 for i in range(10)]


def test_kv_aware_prefers_the_replica_holding_the_longest_leading_run():
    a = FakeReplica("a", set(PROMPT[:2]) | set(PROMPT[5:]))  # a hole after 2 blocks: only 2 count
    b = FakeReplica("b", set(PROMPT[:6]))
    decision = Router("kv_aware").choose([a, b], PROMPT)
    assert (decision.replica.name, decision.matched_blocks) == ("b", 6)


def test_load_counts_against_a_cache_match_and_imbalance_overrides_affinity():
    cached = FakeReplica("cached", set(PROMPT))
    idle = FakeReplica("idle")
    router = Router("kv_aware", cache_weight=1.0, imbalance_threshold=8.0)
    cached.load.in_flight = 5  # 5 queued < 10 uncached blocks elsewhere: affinity wins
    assert router.choose([cached, idle], PROMPT).replica.name == "cached"
    cached.load.in_flight = 11  # costlier than recomputing the prompt elsewhere
    assert router.choose([cached, idle], PROMPT).replica.name == "idle"
    heavy = Router("kv_aware", cache_weight=100.0, imbalance_threshold=8.0)
    cached.load.in_flight = 9  # the spread passes the threshold: least loaded wins whatever the cache
    decision = heavy.choose([cached, idle], PROMPT)
    assert (decision.replica.name, decision.reason) == ("idle", "imbalance")


def test_reported_load_and_kv_usage_count_too():
    busy = FakeReplica("busy", load=ReplicaLoad(reported_running=3, reported_waiting=4))
    full = FakeReplica("full", load=ReplicaLoad(kv_cache_usage=0.95))
    assert Router("least_load").choose([busy, full], PROMPT).replica.name == "full"


def test_round_robin_and_least_load():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router = Router("round_robin")
    assert [router.choose(replicas, PROMPT).replica.name for _ in range(4)] == ["a", "b", "c", "a"]
    replicas[0].load.in_flight, replicas[1].load.in_flight = 2, 1
    assert Router("least_load").choose(replicas, PROMPT).replica.name == "c"


def test_a_session_stays_on_its_replica_while_usable_and_moves_when_not():
    a, b = FakeReplica("a", set(PROMPT)), FakeReplica("b")
    router = Router("session")
    assert router.choose([a, b], PROMPT, session="alice").replica.name == "a"
    a.load.in_flight = 50  # even busy, the conversation stays
    assert router.choose([a, b], [], session="alice").replica.name == "a"
    assert router.choose([b], PROMPT, session="alice").replica.name == "b"  # a is gone: re-pinned
    a.load.in_flight = 0
    assert router.choose([a, b], PROMPT, session="alice").replica.name == "b"


def test_no_candidate_is_an_error():
    with pytest.raises(LookupError):
        Router().choose([], PROMPT)
