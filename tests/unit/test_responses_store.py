"""The stored responses stay within a count and a byte budget (responses_store.py)."""

from __future__ import annotations

import pytest

from heron.entrypoints.openai.responses_store import ResponseStore, StoredResponse


def stored(text: str) -> StoredResponse:
    return StoredResponse({"output": [{"text": text}]}, [{"role": "user", "content": text}])


def test_the_store_keeps_to_its_byte_budget_least_recently_used_first():
    """A count alone let 25 responses carrying 8 MB of text each hold 370 MB."""
    store = ResponseStore(max_entries=100, max_bytes=10_000)
    for index in range(5):
        store.put(f"r{index}", stored("x" * 2_000))
    assert store.num_bytes <= 10_000 and len(store) == 2
    assert store.get("r3", None) is not None and store.get("r4", None) is not None
    store.get("r3", None)  # used last: r4 goes first
    store.put("r5", stored("y" * 2_000))
    assert store.get("r4", None) is None and store.get("r3", None) is not None
    store.put("huge", stored("z" * 20_000))  # alone past the budget: not kept, nothing else lost
    assert store.get("huge", None) is None and len(store) == 2
    assert store.delete("r3", None) and not store.delete("r3", None)
    assert 0 < store.num_bytes < 5_000


def test_the_store_keeps_to_its_count_and_replacing_an_entry_counts_once():
    store = ResponseStore(max_entries=2)
    for index in range(3):
        store.put(f"r{index}", stored("a"))
    assert store.get("r0", None) is None and len(store) == 2
    before = store.num_bytes
    store.put("r2", stored("a"))
    assert store.num_bytes == before
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=0)
