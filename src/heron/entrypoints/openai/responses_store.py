"""The responses a server keeps (``store``, the default): for
``previous_response_id``, ``GET /v1/responses/{id}`` and its ``input_items``. Bounded: at most
``max_entries`` and ``max_bytes`` (their JSON size) are kept, the one used
longest ago going first. A count alone let 25 requests with 8 MB of text
each hold 370 MB, and each entry holds its whole conversation, which grows
along a chain of ``previous_response_id``. Each API-server process keeps its
own (with ``--api-server-count`` > 1, a follow-up may reach another process:
README says so). A response stored under an API key is found only under that
key: another key's client is told it does not exist, as OpenAI scopes
responses to their project."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    conversation: list[dict[str, Any]]  # chat messages up to and including its output, for a follow-up
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, as items with ids
    owner: str | None = None  # the digest of the API key that created it (None: the server takes no keys)


class UnknownItem(LookupError):
    """A listing's ``after`` names no input item of the response."""


def input_items_page(
    items: list[dict[str, Any]], limit: int, order: Literal["asc", "desc"], after: str | None
) -> dict[str, Any]:
    """One page of a response's input items, as OpenAI lists them: ``order``
    "desc" is newest first; ``after`` is the id of the last item of the page
    before (the page starts past it)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise UnknownItem(after)
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 256 << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a response store keeps at least one response")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored``; one larger than ``max_bytes`` on its own is not kept."""
        self._remove(response_id)
        size = _json_size(stored)
        if size > self.max_bytes:
            return
        self._entries[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.num_bytes -= dropped

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """The response stored as ``response_id`` by ``owner``'s key (None: no such, or another key's)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0].owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str, owner: str | None) -> bool:
        entry = self._entries.get(response_id)
        return entry is not None and entry[0].owner == owner and self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        """Forget an entry whoever stored it (``put`` replacing one must not leave its bytes counted)."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry[1]
        return True


def _json_size(stored: StoredResponse) -> int:
    """About the memory an entry holds: its parts' JSON length."""
    return sum(len(json.dumps(part, ensure_ascii=False, default=str))
               for part in (stored.response, stored.conversation, stored.input_items))
