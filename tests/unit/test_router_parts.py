"""The router's decisions without processes: the circuit breaker and the policies."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from heron.router.replica import ReplicaSet
from heron.router.server import RouterServer
from heron.routing.health import BreakerState, CircuitBreaker
from heron.routing.kv_index import KVBlockIndex
from heron.routing.policies import ReplicaLoad, Router


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_client_errors_and_a_requests_own_answers_never_open_the_breaker():
    breaker = CircuitBreaker(failure_threshold=2)
    for status in (400, 404, 422, 429, 400, 413, 504, 501, 505):
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


def test_a_trial_that_ends_with_no_verdict_is_given_to_the_next_request():
    """The half-open trial's client left (or the router's deadline passed)
    before the replica answered: the trial used to stay taken until a probe."""
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, open_seconds=2.0, clock=clock)
    breaker.record(None)
    clock.now = 2.5
    assert breaker.allows() and not breaker.allows()
    breaker.release_trial()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows() and not breaker.allows()
    breaker.record(200)
    breaker.release_trial()  # no trial to release once closed
    assert breaker.state is BreakerState.CLOSED and breaker.allows()


@dataclass
class FakeReplica:
    name: str
    blocks: set[bytes] = field(default_factory=set)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    index: KVBlockIndex = field(default_factory=KVBlockIndex)

    def __post_init__(self) -> None:
        self.index.blocks = self.blocks

    def matched_blocks(self, hashes) -> int:
        return self.index.matched_blocks(hashes)


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
    busy = FakeReplica("busy", load=ReplicaLoad(reported_running=30, reported_waiting=4))
    full = FakeReplica("full", load=ReplicaLoad(kv_cache_usage=0.95))
    assert Router("least_load").choose([busy, full], PROMPT).replica.name == "full"


def test_requests_past_an_engines_capacity_spread_a_shared_prefix():
    """Data parallelism with max_num_seqs 4 and 16 requests sharing a long system
    prompt: one block of load a request never outweighed the prefix, so all 16
    went to one engine (12 waiting) while the other idled. A request past an
    engine's capacity waits for a whole answer, and counts so."""
    shared = [bytes([i]) * 32 for i in range(32)]

    def placed(capacity: int | None) -> list[str]:
        engines = [FakeReplica("0", load=ReplicaLoad(capacity=capacity)),
                   FakeReplica("1", load=ReplicaLoad(capacity=capacity))]
        router, names = Router("kv_aware"), []
        for _ in range(16):
            decision = router.choose(engines, shared)
            decision.replica.load.dispatch(decision.uncached_blocks)
            decision.replica.index.expect(shared)
            names.append(decision.replica.name)
        return names

    assert len(set(placed(None))) == 1  # unknown capacity (a router's replicas): affinity, as before
    spread = placed(4)
    assert min(spread.count("0"), spread.count("1")) >= 6, spread
    assert spread[:5] == [spread[0]] * 5  # the prefix is computed once while there is room


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


def test_a_routed_prompt_is_expected_where_it_went_and_its_prefill_counts_as_load():
    """A burst of one prompt's followers: the first request's blocks are expected
    on its replica before any event confirms them, and the prefill it queued
    there is load, so affinity holds until the work piles up, then spills."""
    clock = FakeClock()
    a, b = FakeReplica("a", index=KVBlockIndex(clock=clock)), FakeReplica("b", index=KVBlockIndex(clock=clock))
    router = Router("kv_aware", imbalance_threshold=1000.0)
    placed = []
    for _ in range(4):
        decision = router.choose([a, b], PROMPT)
        decision.replica.load.dispatch(decision.uncached_blocks)
        decision.replica.index.expect(PROMPT)
        placed.append((decision.replica.name, decision.uncached_blocks))
    first = placed[0][0]
    assert placed[0][1] == 11 and all(name == first and blocks == 1 for name, blocks in placed[1:4]), placed
    a.load.pending_blocks = b.load.pending_blocks = 0
    replica = a if first == "a" else b
    replica.load.pending_blocks = 30  # much prefill queued there: a cache hit is not worth the wait
    assert router.choose([a, b], PROMPT).replica is not replica
    clock.now = 31.0  # never confirmed by an event: the expectation lapses
    assert replica.index.matched_blocks(PROMPT) == 0


def test_the_router_hashes_chat_prompts_but_never_runs_a_clients_template():
    from heron.router.prompt_hashes import CHAT_PATH, PromptHasher

    hasher = PromptHasher(None)
    body = {"messages": [{"role": "user", "content": "tell me a long story about herons " * 8}]}
    assert len(hasher.block_hashes(CHAT_PATH, body, block_size=16)) >= 4
    # a template that would loop for ever is not rendered: the request is placed by load alone
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert hasher.block_hashes(CHAT_PATH, {**body, "chat_template": spin}, block_size=16) == []


def test_a_long_prompt_is_hashed_by_its_beginning_as_the_whole_would_be():
    """A whole 8 MB prompt took 38 s to hash on the router's event loop; only
    its leading blocks decide affinity, and they are the whole text's."""
    from heron.router.prompt_hashes import MAX_HASHED_CHARS, PromptHasher, leading_text

    hasher = PromptHasher(None)
    words = " ".join(f"word{i % 97} and more" for i in range(12000))  # ~170 KB
    assert len(words) > 2 * MAX_HASHED_CHARS
    cut, was_cut = leading_text(words)
    assert was_cut and len(cut) <= MAX_HASHED_CHARS and words.startswith(cut) and words[len(cut)] == " "
    assert leading_text("short") == ("short", False)
    hashes = hasher.block_hashes("/v1/completions", {"prompt": words}, block_size=16)
    whole = hasher._encode(words, True)  # noqa: SLF001
    from heron.core.hashing import prompt_block_hashes

    expected = prompt_block_hashes(whole, 16, None)
    assert 0 < len(hashes) < len(expected) and hashes == expected[: len(hashes)]
    assert len(hashes) >= MAX_HASHED_CHARS // 5 // 16  # about the whole bound's worth of blocks
    ids = [i % 1000 for i in range(100000)]
    assert len(hasher.block_hashes("/v1/completions", {"prompt": ids}, block_size=16)) == (1 << 14) // 16


def test_the_response_id_is_found_however_the_answer_is_cut():
    from heron.router.response_affinity import ResponseAffinity, ResponseIdScanner

    body = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_0a1b2c","object"'
    for cut in range(1, len(body)):
        scanner = ResponseIdScanner()
        scanner.feed(body[:cut])
        scanner.feed(body[cut:])
        assert scanner.found == "resp_0a1b2c"
    affinity = ResponseAffinity(max_entries=2)
    for name in ("resp_a", "resp_b", "resp_c"):
        affinity.remember(name, "http://replica-" + name)
    assert affinity.replica_of("resp_a") is None and affinity.replica_of("resp_c") == "http://replica-resp_c"
    assert affinity.replica_of(None) is None


@pytest.mark.parametrize("path, response_id", [
    ("/v1/responses/resp_1", "resp_1"),
    ("/v1/responses/resp_1/input_items", "resp_1"),
    ("/v1/responses/resp_1/cancel", "resp_1"),
    ("/v1/responses", None),
    ("/v1/responses/", None),
    ("/v1/responses/resp_1/other", None),
    ("/v1/responsesX/resp_1", None),
])
def test_the_paths_of_a_stored_response_name_it(path, response_id):
    from heron.router.response_affinity import stored_response_id

    assert stored_response_id(path) == response_id


def test_each_failed_trial_doubles_the_rest_and_late_failures_change_nothing():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, open_seconds=2.0, max_open_seconds=30.0, clock=clock)
    for _ in range(3):
        breaker.record(None)
    periods = []
    for _ in range(5):  # a dead replica: each probe, when due, is the half-open trial (allows()) and fails
        clock.now += 100
        assert breaker.allows()
        breaker.record(None)
        periods.append(breaker._current_open_seconds)
    assert periods == [4.0, 8.0, 16.0, 30.0, 30.0]
    clock.now += 1
    breaker.record(None)  # a request sent before it opened times out only now
    assert breaker.state is BreakerState.OPEN and breaker._current_open_seconds == 30.0
    clock.now += 10
    assert not breaker.usable  # the open period was not restarted or shortened


def test_expectations_never_confirmed_are_dropped_as_they_lapse():
    clock = FakeClock()
    index = KVBlockIndex(clock=clock)
    for second in range(100):  # a replica with events off: nothing ever confirms what was sent there
        clock.now = float(second)
        index.expect([bytes([second]) * 32, bytes([second, 1]) * 16])
    assert len(index.expected) == 2 * 31  # the last 30 seconds' worth, whatever was never looked up
    clock.now = 100.0
    index.expect([bytes([70]) * 32])  # expected again: it counts from now
    clock.now = 129.5
    index.expect([])
    assert list(index.expected) == [bytes([70]) * 32]


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_TURNS = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "How is Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 degrees and sunny"},
]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": TOOL_TURNS[1:2], "tools": [TOOL]}),  # tools, no system message
    ("/v1/chat/completions", {"messages": TOOL_TURNS, "tools": [TOOL]}),  # a call and its result
    ("/v1/chat/completions", {"messages": TOOL_TURNS}),  # tool turns without tools
    ("/v1/responses", {"input": "How is Paris?", "instructions": "Be brief.",
                       "tools": [{"type": "function", "name": "get_weather", "parameters": TOOL["function"][
                           "parameters"]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": "Hi"},
                                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]}),
])
@pytest.mark.parametrize("chat_template", [None, "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"])
def test_the_router_hashes_the_prompt_the_replica_renders(path, body, chat_template):
    """Tools (written into the system message) and tool turns were rendered
    without them (0 of 10 leading blocks matched the replica's); Responses
    requests were not hashed at all; a replica's --chat-template had no
    counterpart in the router. The replica's own rendering is the reference."""
    from types import SimpleNamespace

    from heron.core.hashing import prompt_block_hashes
    from heron.entrypoints.openai.protocol import ChatCompletionRequest
    from heron.entrypoints.openai.protocol_responses import ResponsesRequest
    from heron.entrypoints.openai.serving_chat import chat_prompt
    from heron.entrypoints.openai.serving_responses import chat_request, input_messages
    from heron.router.prompt_hashes import PromptHasher

    hasher = PromptHasher(None, chat_template=chat_template)
    processor = PromptHasher(None).processor  # the replica's, with the model's own template
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=processor.tokenizer, input_processor=processor),
                          chat_template=chat_template, trust_request_chat_template=False)
    if path == "/v1/responses":
        request = ResponsesRequest.model_validate(body)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat = chat_request(request, system + input_messages(request))
    else:
        chat = ChatCompletionRequest.model_validate(body)
    expected = prompt_block_hashes(chat_prompt(ctx, chat).token_ids, 4, None)
    assert len(expected) > 3
    assert hasher.block_hashes(path, body, block_size=4) == expected


def test_a_replica_with_other_blocks_is_named(caplog):
    """The router hashes prompts in one block size, the first replica's: a replica
    started with another --block-size never matched, and the last one followed
    silently changed the size for all."""
    from heron.router.replica import ReplicaSet

    replicas = ReplicaSet(["http://127.0.0.1:1", "http://127.0.0.1:2"], {})
    try:
        first, second = replicas.replicas
        with caplog.at_level("WARNING", logger="heron.router.replica"):
            replicas._note_block_size(first, 32)
            replicas._note_block_size(second, 16)
            replicas._note_block_size(first, 32)
        assert replicas.block_size == 32
        assert caplog.text.count("stores KV in blocks of 16 tokens") == 1 and "--block-size" in caplog.text
    finally:
        replicas.context.destroy(0)


def test_a_replica_discovery_dropped_has_no_gauges_left():
    """/metrics kept heron_router_replica_usable 1 for a replica that had left
    (a dashboard summing usable replicas over-counted; Ray churn grew the series)."""
    async def main() -> None:
        replicas = ReplicaSet([], {}, discover=None)
        server = RouterServer(replicas, Router("round_robin"), None)
        replicas.set_discovered(["http://127.0.0.1:1", "http://127.0.0.1:2"])
        assert server._prometheus().count(b'heron_router_replica_usable{replica=') == 2  # noqa: SLF001
        replicas.set_discovered(["http://127.0.0.1:2"])
        rendered = server._prometheus()  # noqa: SLF001
        assert b"127.0.0.1:1" not in rendered and b'heron_router_in_flight{replica="http://127.0.0.1:2"}' in rendered
        replicas.context.destroy(0)

    asyncio.run(main())
