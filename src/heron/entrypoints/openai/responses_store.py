"""The responses a server keeps (``store``, the default): for
``previous_response_id`` and ``GET /v1/responses/{id}``. Bounded: the newest
``max_entries`` are kept, the one used longest ago goes first. Each API-server
process keeps its own (with ``--api-server-count`` > 1, a follow-up may reach
another process: README says so)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    conversation: list[dict[str, Any]]  # chat messages up to and including its output, for a follow-up


class ResponseStore:
    def __init__(self, max_entries: int = 1024) -> None:
        if max_entries < 1:
            raise ValueError("a response store keeps at least one response")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
