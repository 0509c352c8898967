"""Fuzzing the live server with schemathesis, from heron's own OpenAPI schema
(issue #20, item 4): every operation (/v1/*, /tokenize, /detokenize, /health,
/version) with generated bodies, valid and invalid. No input may produce a
5xx; a 4xx must carry OpenAI's error shape. The number of cases tried is
printed (pytest -s) and bounded by MAX_EXAMPLES per operation and mode
(inputs the schema allows, and inputs it forbids)."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.e2e.server_process import ServerProcess

# per operation and mode; HERON_FUZZ_EXAMPLES=1000 for a deeper run
MAX_EXAMPLES = int(os.environ.get("HERON_FUZZ_EXAMPLES", "60"))
TRIED: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzzed_server():
    server = ServerProcess("--max-model-len", "128")
    yield server
    server.stop()
    print(f"\nschemathesis cases per operation: {TRIED} ({sum(TRIED.values())} in all)")


def test_no_input_makes_a_server_error(fuzzed_server):
    api = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 6
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode)
    assert all(TRIED.get(f"{operation.label} positive") for operation in operations), TRIED


def fuzz(operation, mode: GenerationMode) -> None:
    """``mode``: inputs the schema allows, or inputs it forbids (a wrong type, a
    missing required field, a value out of range...)."""
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        response = case.call(timeout=60)
        key = f"{operation.label} {mode.value}"
        TRIED[key] = TRIED.get(key, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        if 400 <= response.status_code < 500 and response.status_code not in (404, 405):
            error = response.json()["error"]
            assert {"message", "type", "param", "code"} <= set(error), error

    try:
        one()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # nothing to get wrong: an operation without input
