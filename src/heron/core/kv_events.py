"""KV-cache events: what a replica's prefix cache gained and lost, in vLLM's
shapes, so a router can keep an index of every replica's cache from the
replica's own reports instead of guessing from its routing history.

* ``BlockStored``: blocks registered in the prefix cache (their chained hashes,
  the parent of the first, their token ids, the block size);
* ``BlockRemoved``: cached blocks evicted (their hashes);
* ``AllBlocksCleared``: the whole prefix cache was reset.

The block pool records them as they happen (``KVEventRecorder``); the engine
core takes them after every step and publishes them as one ``KVEventBatch``.
Hashes are SHA-256 chains (``core/hashing.py``): the same prompt gives the same
hashes in every process and on every machine, so a router can hash a prompt
itself and look it up.

Wire format (msgpack): a batch is ``[ts, [event, ...], data_parallel_rank]``;
an event is ``["BlockStored", [hash, ...], parent_hash | None, [token, ...],
block_size, lora_id | None, medium]``, ``["BlockRemoved", [hash, ...],
medium]`` or ``["AllBlocksCleared"]``; hashes are 32-byte strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from heron.core.hashing import BlockHash

MEDIUM = "GPU_OR_CPU_POOL"
# the replay socket's last answer to a request: sequence number -1, no batch
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the engine's own block pool (offload tiers will name theirs)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]  # every stored block's tokens, in order
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float  # time.time() when the step's events were taken
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class KVEventRecorder:
    """Events of the current step, in order. Consecutive removals merge into
    one ``BlockRemoved``; stores come one call per request and step, already
    grouped."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int],
               block_size: int) -> None:
        if block_hashes:
            self.events.append(BlockStored(block_hashes, parent, token_ids, block_size))

    def removed(self, block_hash: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_encode_event(e) for e in batch.events], batch.data_parallel_rank])


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its wire form; ValueError names what is malformed."""
    try:
        ts, events, rank = msgpack.unpackb(payload)
        return KVEventBatch(float(ts), [_decode_event(e) for e in events], rank)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc


def _encode_event(event: KVCacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def _decode_event(fields: Sequence[Any]) -> KVCacheEvent:
    kind = fields[0]
    if kind == "BlockStored":
        _, hashes, parent, token_ids, block_size, lora_id, medium = fields
        if parent is not None:
            _check_hash(parent)
        return BlockStored(_hashes(hashes), parent, list(token_ids), int(block_size), lora_id, medium)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields[1]), fields[2])
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event kind {kind!r}")


def _hashes(value: Any) -> list[Any]:
    """A batch's block hashes: a list of bytes (heron's) or integers (another
    engine's form), never anything an index could not hold."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"block hashes must be a list, not {type(value).__name__}")
    for block_hash in value:
        _check_hash(block_hash)
    return list(value)


def _check_hash(block_hash: Any) -> None:
    if isinstance(block_hash, bool) or not isinstance(block_hash, (bytes, int)):
        raise TypeError(f"a block hash must be bytes or an integer, not {type(block_hash).__name__}")
