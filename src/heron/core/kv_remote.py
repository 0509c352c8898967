"""What the scheduler asks the worker to pull from a prefill engine
(``worker/kv_transfer.py`` does it)."""

from __future__ import annotations

from dataclasses import dataclass

from heron.core.hashing import BlockHash


@dataclass(slots=True)
class RemoteLoad:
    """Pull ``blocks`` (hash, pool block id), the run of blocks starting at block
    ``first`` of request ``remote_request_id`` on the engine at ``address``, for
    request ``request_id``."""

    request_id: str
    address: str
    remote_request_id: str
    first: int
    blocks: list[tuple[BlockHash, int]]

    @property
    def block_hashes(self) -> list[BlockHash]:
        """The hashes of ``blocks``, in order: what a pull and its release name."""
        return [block_hash for block_hash, _ in self.blocks]
