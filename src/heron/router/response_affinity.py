"""Where each stored response lives. The Responses API is stateful: a
follow-up (``previous_response_id``), ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` must reach the replica that answered the response they
name. The router learns a response's id from the first bytes of the answer
it relays (the JSON body, or the ``response.created`` event, both name it
early) and remembers the newest ``max_entries``."""

from __future__ import annotations

import re
from collections import OrderedDict

RESPONSES_PATH = "/v1/responses"
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9]+)"')
# how far into an answer its id is looked for (it comes in the first event or field)
SCAN_BYTES = 8192


def stored_response_id(path: str) -> str | None:
    """The response id of a path that reads, cancels or deletes a stored response
    (``/v1/responses/{id}``, ``/v1/responses/{id}/input_items``, ``.../cancel``), else None."""
    parts = path[len(RESPONSES_PATH) + 1 :].split("/") if path.startswith(RESPONSES_PATH + "/") else []
    if len(parts) == 1 or (len(parts) == 2 and parts[1] in ("input_items", "cancel")):
        return parts[0] or None
    return None


class ResponseAffinity:
    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._replicas: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    def remember(self, response_id: str, replica_url: str) -> None:
        self._replicas[response_id] = replica_url
        self._replicas.move_to_end(response_id)
        while len(self._replicas) > self.max_entries:
            self._replicas.popitem(last=False)

    def replica_of(self, response_id: str | None) -> str | None:
        return self._replicas.get(response_id) if response_id else None


class ResponseIdScanner:
    """Finds the response id in the first ``SCAN_BYTES`` of a relayed answer."""

    def __init__(self) -> None:
        self.head = b""
        self.found: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self.found is not None or len(self.head) >= SCAN_BYTES:
            return
        self.head += chunk[: SCAN_BYTES - len(self.head)]
        match = _RESPONSE_ID.search(self.head)
        if match:
            self.found = match.group(1).decode()
