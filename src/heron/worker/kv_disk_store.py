"""The worker's half of the disk KV tier (``core/kv_disk_index.py``): block
files written and read by two background threads, so the step loop only
copies blocks out of the pool.

- ``apply`` (at the start of a step, before its forward pass): copies the
  blocks to write out of the pool (together: a copy or two per layer, one
  row per block) and queues each row; queues deletes after
  the writes (in one FIFO, so a delete never overtakes a write of the same
  block); queues the loads.
- The writer writes ``<name>.<pid>-<random>.tmp`` then renames it over the
  block's file (a reader sees a whole file or none; the random part keeps
  replicas in other PID namespaces sharing the directory apart), skipping blocks already on disk
  (another replica wrote them). A failed write (disk full) loses that block
  only: a later load of it fails and is handled by the load-failure policy.
- The loader reads each block, from the writer's queue when not written yet,
  else from its file, into a row of one buffer per batch of blocks, checks it
  (``DiskTierLayout.check_parts``), and copies the batch into its pool blocks
  together; a block it cannot read is reported failed (a corrupt file is
  removed). Pool blocks being loaded belong to a waiting request that no step
  reads, so the copies may overlap a forward pass.

Buffered writes are bounded (``max_buffered_bytes``, checked before each batch
of at most ``_WRITE_BATCH_BLOCKS`` blocks; a written row's bytes are freed with
the last row of its batch): past it, ``apply`` waits for the writer, so a
slow disk slows the engine rather than filling memory. The model runner
waits for room before a step's copies (``wait_for_room``, where a Ctrl-C may
stop it) and then captures them whole (``capture(..., wait=False)``): the
bound may be passed by one step's writes.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from heron.core.hashing import BlockHash
from heron.core.kv_disk_index import DiskLoad, DiskOps
from heron.core.kv_disk_layout import HEADER_BYTES, CorruptBlockFile, DiskTierLayout
from heron.worker.kv_block_codec import BlockCodec
from heron.worker.kv_load_reports import LoadReports

logger = logging.getLogger(__name__)

_STOP = None
_READ, _MISSING, _UNUSABLE = "read", "missing", "unusable"  # what reading a block file found
_LOAD_BATCH_BLOCKS = 64  # blocks read into one buffer before they are copied into the pool
# blocks captured together for writing: a row of a batch keeps the whole batch's
# buffer alive, so at most this many blocks' bytes sit beyond the bound unseen
_WRITE_BATCH_BLOCKS = 32


class DiskKVStore:
    def __init__(self, layout: DiskTierLayout, caches: Sequence[torch.Tensor], reports: LoadReports,
                 max_buffered_bytes: int = 512 << 20) -> None:
        """``caches``: every attention layer's pool cache, each
        ``[2, num_blocks, block_size, heads, head_dim]``; finished loads go to ``reports``."""
        self.layout = layout
        self.codec = BlockCodec(caches)
        if self.codec.block_bytes != layout.payload_bytes:
            raise ValueError(f"the disk tier's layout holds {layout.payload_bytes} bytes per block, "
                             f"the caches {self.codec.block_bytes}")
        self.max_buffered_bytes = max_buffered_bytes
        self._tmp_suffix = f".{os.getpid()}-{secrets.token_hex(4)}.tmp"  # this writer's alone
        self._lock = threading.Condition()
        self._buffered: dict[BlockHash, torch.Tensor] = {}  # captured, not written yet
        self._buffered_bytes = 0
        self._writes: queue.Queue[tuple[str, BlockHash, torch.Tensor | None] | None] = queue.Queue()
        self._loads: queue.Queue[DiskLoad | None] = queue.Queue()
        self.reports = reports
        self._write_errors = 0
        self._failed_writes: list[BlockHash] = []  # blocks the tier's index counts, with no file (under _lock)
        # the threads hold the store weakly: an engine dropped without close() is
        # collected, and its threads stop with it
        self._threads = [
            threading.Thread(target=_serve, args=(weakref.ref(self), self._writes, DiskKVStore._write_one),
                             name="kv-disk-writer", daemon=True),
            threading.Thread(target=_serve, args=(weakref.ref(self), self._loads, DiskKVStore._load_one),
                             name="kv-disk-loader", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        weakref.finalize(self, _stop, self._writes, self._loads)

    # ---- the step loop's side ---------------------------------------------

    def apply(self, ops: DiskOps) -> None:
        """A step's disk operations, when no host-tier copies come between them."""
        self.capture(ops)
        self.start_loads(ops)

    def wait_for_room(self) -> None:
        """Until the buffered writes are under their bound."""
        with self._lock:
            self._lock.wait_for(lambda: self._buffered_bytes < self.max_buffered_bytes)

    @torch.inference_mode()
    def capture(self, ops: DiskOps, wait: bool = True) -> None:
        """Copy the blocks to write out of the pool (the writer thread writes them) and queue the deletes;
        ``wait``: for room before each batch (else at once, past the bound if need be)."""
        for start in range(0, len(ops.writes), _WRITE_BATCH_BLOCKS):
            batch = ops.writes[start:start + _WRITE_BATCH_BLOCKS]
            if wait:
                self.wait_for_room()
            # one list of row views: iterating the captured tensor makes new view objects each time, and the
            # writer's identity check (is this still the buffered copy?) then never matched: every block ever
            # written stayed in host memory (RSS grew ~125 MB a round of 3,200 new tokens on the embedded model)
            rows = list(self.codec.capture([block_id for block_id, _ in batch]))
            with self._lock:
                for (_, block_hash), buffer in zip(batch, rows, strict=True):
                    self._buffered[block_hash] = buffer
                    self._buffered_bytes += buffer.numel()
            for (_, block_hash), buffer in zip(batch, rows, strict=True):
                self._writes.put(("write", block_hash, buffer))
        for block_hash in ops.deletes:
            self._writes.put(("delete", block_hash, None))

    def start_loads(self, ops: DiskOps) -> None:
        """Hand the step's loads to the loader thread. Only after every other copy
        out of the blocks they fill is queued (the captures of ``apply``, the host
        tier's saves): a block evicted and refilled in one step must leave the pool
        with its old contents before the loader overwrites it."""
        if ops.loads:
            self.reports.started(len(ops.loads))
            for load in ops.loads:
                self._loads.put(load)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every captured block is written (or failed to); whether it was in time."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._buffered_bytes, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (a restart finds them) and stop both threads."""
        _stop(self._writes, self._loads)
        for thread in self._threads:
            thread.join(timeout)

    # ---- the writer ---------------------------------------------------------

    def _write_one(self, item: tuple[str, BlockHash, torch.Tensor | None]) -> None:
        kind, block_hash, buffer = item
        path = self.layout.path_for(block_hash)
        if kind == "delete":
            try:
                path.unlink(missing_ok=True)
            except OSError as error:  # a read-only or failing file system: the file stays, the writer goes on
                self._count_error("delete", path, error)
            return
        assert buffer is not None
        try:
            if not path.is_file():
                self._write_file(block_hash, buffer)
        except OSError as error:
            self._count_error("write", path, error)
            with self._lock:
                self._failed_writes.append(block_hash)
        finally:
            with self._lock:
                if self._buffered.get(block_hash) is buffer:
                    del self._buffered[block_hash]
                self._buffered_bytes -= buffer.numel()
                self._lock.notify_all()

    def take_failed_writes(self) -> list[BlockHash]:
        """The blocks whose write failed since the last call (a full or read-only
        disk): the tier's index forgets them, which it counted as held (its
        metrics said so, and a request that hit one paid for a load that failed,
        or failed itself under the fail policy)."""
        with self._lock:
            failed, self._failed_writes = self._failed_writes, []
        return failed

    def _count_error(self, action: str, path: Path, error: OSError) -> None:
        self._write_errors += 1
        if self._write_errors == 1 or self._write_errors % 1000 == 0:
            logger.warning("disk KV tier: cannot %s %s (%s; %d failed writes and deletes)", action, path, error,
                           self._write_errors)

    def _write_file(self, block_hash: BlockHash, buffer: torch.Tensor) -> None:
        path = self.layout.path_for(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)  # the tier's directory too, if it was removed (a cleaner)
        payload = memoryview(buffer.numpy().data)
        tmp = path.with_name(path.name + self._tmp_suffix)
        try:
            with open(tmp, "wb") as file:
                file.write(self.layout.header(block_hash, payload))
                file.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    # ---- the loader ---------------------------------------------------------

    @torch.inference_mode()
    def _load_one(self, load: DiskLoad) -> None:
        """Read the blocks into one buffer per batch, then copy each batch into the
        pool with a copy per layer (few Python calls: the step loop keeps the GIL)."""
        failed: list[BlockHash] = []
        first_failure_missed = False
        try:
            for start in range(0, len(load.blocks), _LOAD_BATCH_BLOCKS):
                batch = load.blocks[start:start + _LOAD_BATCH_BLOCKS]
                rows = torch.empty((len(batch), self.codec.block_bytes), dtype=torch.uint8)
                good = []
                for row, (block_hash, _) in enumerate(batch):
                    state = self._read_block(block_hash, rows[row])
                    if state == _READ:
                        good.append(row)
                        continue
                    if not failed:
                        first_failure_missed = state == _MISSING
                    failed.append(block_hash)
                if good:
                    self.codec.restore(rows if len(good) == len(batch) else rows[good],
                                       [batch[row][1] for row in good])
        except Exception:  # a bug must not leave the request waiting: every block failed (recomputed)
            logger.exception("disk KV tier: loading %s failed", load.request_id)
            failed = [block_hash for block_hash, _ in load.blocks]
            first_failure_missed = False
        self.reports.finished(load.request_id, failed, missed=first_failure_missed)

    def _read_block(self, block_hash: BlockHash, row: torch.Tensor) -> str:
        """Fill ``row`` with the block's bytes (from the writer's queue when not
        written yet, else from its file, checked): ``_READ``, or ``_MISSING`` (no
        file: deleted by another replica sharing the directory), or ``_UNUSABLE``
        (a file that cannot be read or fails its checks: removed)."""
        with self._lock:
            buffered = self._buffered.get(block_hash)
        if buffered is not None:
            row.copy_(buffered)
            return _READ
        path = self.layout.path_for(block_hash)
        payload = row.numpy().data
        try:
            with open(path, "rb") as file:
                header = file.read(HEADER_BYTES)
                read = file.readinto(payload)
                if read != len(payload) or file.read(1):
                    raise CorruptBlockFile(f"not {self.layout.file_bytes} bytes long")
            self.layout.check_parts(block_hash, header, payload)
        except FileNotFoundError:
            return _MISSING
        except (OSError, CorruptBlockFile) as error:
            logger.warning("disk KV tier: %s unusable (%s); removed", path, error)
            path.unlink(missing_ok=True)
            return _UNUSABLE
        return _READ


def _serve(store_ref: weakref.ref[DiskKVStore], items: queue.Queue[Any], handle: Callable[[DiskKVStore, Any], None],
           ) -> None:
    """A background thread's loop: each queued item to ``handle`` until told to stop."""
    while (item := items.get()) is not _STOP:
        store = store_ref()
        if store is None:
            return
        try:
            handle(store, item)
        except Exception:  # a bug in one item must not end the thread: later steps would wait on it for ever
            logger.exception("disk KV tier: %s failed", getattr(handle, "__name__", "a background task"))
        del store


def _stop(*queues: queue.Queue[Any]) -> None:
    for items in queues:
        items.put(_STOP)
