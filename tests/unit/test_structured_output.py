"""Structured output without a model: constraint parameters and validation, and
the scheduler keeping a request whose grammar is still compiling in its own
waiting state while the others run."""

from __future__ import annotations

import json

import pytest

from heron.request import RequestStatus
from heron.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams
from heron.structured_output.xgrammar_backend import choice_regex, validate_constraint
from tests.helpers import make_request
from tests.unit.test_scheduler import add, make_scheduler, step


def test_exactly_one_constraint_and_keys():
    with pytest.raises(SamplingParamError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(SamplingParamError, match="choice"):
        StructuredOutputsParams(choice=[])
    for kind, value in (("regex", ["a"]), ("grammar", {"x": 1})):  # a 500: unhashable in the grammar cache
        with pytest.raises(SamplingParamError, match=f"structured_outputs.{kind} must be a string"):
            StructuredOutputsParams(**{kind: value})
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert StructuredOutputsParams(json=schema).key() == ("json",
                                                          '{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert StructuredOutputsParams(choice=["x", "y"]).key() == ("choice", '["x", "y"]')
    assert StructuredOutputsParams(json_object=True).key() == ("json_object", "")
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")


@pytest.mark.parametrize(
    "kind, spec, fragment",
    [
        ("json", "{not json", "not valid JSON"),
        ("json", '{"type": "no-such-type"}', "invalid json"),
        ("regex", "(unclosed", "invalid regex"),
        ("grammar", "root ::= undefined_rule", "invalid grammar"),
    ],
)
def test_bad_constraints_are_rejected_with_the_reason(kind, spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        validate_constraint(kind, spec)


def test_good_constraints_validate():
    validate_constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    validate_constraint("regex", r"\d{3}-\d{4}")
    validate_constraint("grammar", 'root ::= "yes" | "no"')
    validate_constraint("choice", '["a.b", "c|d"]')
    assert choice_regex(["a.b", "c|d"]) == r"(a\.b|c\|d)"


class FakeGrammars:
    """Stands in for the StructuredOutputManager: readiness is set by the test,
    and the grammar accepts any token and never terminates."""

    def __init__(self) -> None:
        self.ready: dict[str, bool | None] = {}
        self.removed: list[str] = []

    def is_ready(self, request):
        return self.ready.get(request.request_id, False)

    def remove_request(self, request_id: str) -> None:
        self.removed.append(request_id)

    def take_error(self, request_id: str) -> str | None:
        return f"{request_id}'s grammar did not compile" if self.ready.get(request_id, False) is None else None

    def accept(self, request_id: str, token_id: int) -> bool:
        return True

    def is_terminated(self, request_id: str) -> bool:
        return False


def scheduler_with_grammars():
    """A scheduler with fake grammars, a structured request and a plain one."""
    scheduler = make_scheduler()
    grammars = FakeGrammars()
    scheduler.structured_output = grammars  # type: ignore[assignment]
    structured = make_request(8, max_tokens=3, structured_outputs={"regex": "a+"})
    plain = make_request(8, token_offset=50, max_tokens=3)
    add(scheduler, structured, plain)
    return scheduler, grammars, structured, plain


def test_request_waits_for_its_grammar_while_others_run():
    scheduler, grammars, structured, plain = scheduler_with_grammars()
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == [plain.request_id]
    assert structured.status == RequestStatus.WAITING and scheduler.waiting.peek() is structured
    grammars.ready[structured.request_id] = True
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {structured.request_id, plain.request_id}
    # the structured request samples this step (its whole prompt fits), so it needs a bitmask row
    assert scheduler.structured_requests_to_sample(out) == [structured.request_id]


def test_failed_grammar_aborts_only_that_request():
    scheduler, grammars, broken, plain = scheduler_with_grammars()
    grammars.ready[broken.request_id] = None
    out, result = step(scheduler)
    assert list(out.num_scheduled_tokens) == [plain.request_id]
    [aborted] = [o for o in result.outputs if o.request_id == broken.request_id]
    assert aborted.finish_reason == "abort" and aborted.error == f"{broken.request_id}'s grammar did not compile"
    assert broken.request_id not in scheduler.requests and grammars.removed == [broken.request_id]
    assert len(scheduler.waiting) == 0
    scheduler.kv_cache_manager.check_integrity()


def test_a_grammar_no_output_satisfies_fails_its_compile(embedded_tokenizer):
    """``root ::= root`` parses, but no derivation ends: its first step allowed
    no token, EOS included, so the request ran its prefill, sampled token 0
    against all -inf logits and was then aborted with an error logged. Its
    compile now fails, which ends the request before any work."""
    from heron.structured_output.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(embedded_tokenizer, len(embedded_tokenizer), [embedded_tokenizer.eos_token_id])
    validate_constraint("grammar", "root ::= root")  # well-formed: only a tokenizer can tell
    with pytest.raises(ValueError, match="allows no output"):
        backend.compile("grammar", "root ::= root")
    assert backend.compile("grammar", 'root ::= "yes" | "no"') is not None


def allowed_tokens(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    return {token for token in range(backend.vocab_size) if (int(bitmask[0, token >> 5]) >> (token & 31)) & 1}


@pytest.mark.parametrize("bound", [{"maxLength": 6}, {"minLength": 2}])
def test_a_length_bounded_json_string_allows_no_raw_control_character(embedded_tokenizer, bound):
    """xgrammar's string with a length bound admits raw control characters
    (its issue 800): the fuzz review's seeded request answered
    '{"a":0,"b":"anah\\x10L"}', which json.loads refuses. Tokens holding one
    are masked for JSON output; other constraints keep them."""
    from heron.structured_output.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(embedded_tokenizer, len(embedded_tokenizer), [embedded_tokenizer.eos_token_id])
    control = {token for token in range(backend.vocab_size)
               if any(0x20 > ord(char) and char not in "\t\n\r" for char in embedded_tokenizer.decode([token]))}
    assert control  # the vocabulary has single control-character tokens
    schema = {"type": "object", "properties": {"b": {"type": "string", **bound}}, "required": ["b"]}
    matcher = backend.matcher(backend.compile("json", json.dumps(schema)))
    for token in embedded_tokenizer.encode('{"b": "an', add_special_tokens=False):
        assert matcher.accept_token(token)
    inside_the_string = allowed_tokens(backend, matcher)
    assert not inside_the_string & control
    assert embedded_tokenizer.encode("x", add_special_tokens=False)[0] in inside_the_string
    anything = backend.matcher(backend.compile("regex", "(.|\\x10)*"))
    assert control <= allowed_tokens(backend, anything)


def test_xgrammar_keeps_no_cache_of_its_own(embedded_tokenizer):
    # its default cache has no bound: 1.8 MB a distinct schema here, for ever (the manager's LRU is bounded)
    from heron.structured_output.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(embedded_tokenizer, len(embedded_tokenizer), [embedded_tokenizer.eos_token_id])
    for bound in range(3):
        backend.compile("json", json.dumps({"type": "string", "maxLength": bound + 1}))
    assert backend._compiler.get_cache_size_bytes() == 0


def test_a_slow_compile_does_not_hold_up_the_next_grammar():
    """Two compile workers: a grammar that takes long to compile (seconds, for a
    schema of large string bounds) kept every structured request queued behind it."""
    import threading
    import time

    from heron.structured_output.manager import StructuredOutputManager

    release = threading.Event()

    class Backend:
        def compile(self, kind: str, spec: str) -> str:
            if spec == "slow":
                release.wait(30)
            return spec

        def matcher(self, compiled: str) -> object:
            return object()

    manager = StructuredOutputManager(model_config=None)  # type: ignore[arg-type]
    manager._backend = Backend()  # type: ignore[assignment]
    slow = make_request(2, request_id="slow", structured_outputs={"regex": "slow"})
    fast = make_request(2, request_id="fast", structured_outputs={"regex": "fast"})
    try:
        manager.add_request(slow)
        manager.add_request(fast)
        deadline = time.monotonic() + 10
        while not manager.is_ready(fast) and time.monotonic() < deadline:
            manager.wait_for_compile(0.05)
        assert manager.is_ready(fast) and not manager.is_ready(slow)
    finally:
        release.set()
        manager.shutdown()


def test_a_compile_nobody_waits_for_is_cancelled_before_it_starts():
    """Clients that left queued their grammars' compiles ahead of every new
    structured request: a minute's wait for a regex after six departed schemas."""
    import threading
    import time

    from heron.structured_output.manager import StructuredOutputManager

    release = threading.Event()
    compiled: list[str] = []

    class Backend:
        def compile(self, kind: str, spec: str) -> str:
            if spec.startswith("slow"):
                release.wait(30)
            compiled.append(spec)
            return spec

        def matcher(self, compiled: str) -> object:
            return object()

    manager = StructuredOutputManager(model_config=None)  # type: ignore[arg-type]
    manager._backend = Backend()  # type: ignore[assignment]
    requests = {name: make_request(2, request_id=name, structured_outputs={"regex": spec})
                for name, spec in [("a", "slow1"), ("b", "slow2"), ("left", "queued"), ("stays", "shared"),
                                   ("also", "shared")]}
    try:
        for request in requests.values():
            manager.add_request(request)  # two compile workers: a and b run, the rest queue
        manager.remove_request("left")  # nobody else waits for it: never compiled
        manager.remove_request("also")  # "stays" still waits for the same grammar: compiled
        release.set()
        deadline = time.monotonic() + 10
        while not manager.is_ready(requests["stays"]) and time.monotonic() < deadline:
            manager.wait_for_compile(0.05)
        assert manager.is_ready(requests["stays"])
        assert "queued" not in compiled
        again = make_request(2, request_id="again", structured_outputs={"regex": "queued"})
        manager.add_request(again)  # a new request for the cancelled grammar compiles it
        while not manager.is_ready(again) and time.monotonic() < deadline:
            manager.wait_for_compile(0.05)
        assert manager.is_ready(again) and compiled.count("queued") == 1
    finally:
        release.set()
        manager.shutdown()
