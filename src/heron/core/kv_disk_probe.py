"""Which block files a disk KV tier's directory holds, asked of the file
system off the step loop.

The disk index (``core/kv_disk_index.py``) knows the blocks it scanned at
start and those it wrote; a block another replica wrote since is found only
by asking the file system (a ``stat``). On a local disk that is a few
microseconds, but on a network file system each ``stat`` is a round trip
(0.6 to 2 ms over sshfs on loopback): a 2,000-token prompt that another
replica prefilled costs 123 of them, 80 to 120 ms in which the step loop that
made them held every running request still. So the index asks inline only within a
small budget of file-system time per step, and hands the rest of a prompt's
run of blocks to this prober: threads that check it in order, in up to four
pieces at once, each up to its first block missing, while the request waits
without holding anyone up.

Answers go stale (another replica writes or deletes a file at any time):
"present" is taken into the index (unless this replica deleted the block
since it asked), where a later failed load corrects it; "missing" is
believed for ``MISSING_TTL_S``, long enough for the request that asked to be
admitted on it. A lookup that gets no answer within ``LOOKUP_TIMEOUT_S`` (a
hung file server) is a miss.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence

from heron.core.hashing import BlockHash
from heron.core.kv_disk_layout import DiskTierLayout

MISSING_TTL_S = 1.0
# a lookup pending this long counts as a miss (the prefix is recomputed): a hung
# file server costs a request this, and never holds it for ever
LOOKUP_TIMEOUT_S = 1.0
# runs checked at once: a network file system's stats are round trips, and one
# long run (or one that hangs) must not hold up the next request's single miss
PROBE_THREADS = 4
MIN_PIECE = 8  # blocks: a shorter run is checked by one thread
_STOP = None


class DiskProbe:
    def __init__(self, layout: DiskTierLayout) -> None:
        self.layout = layout
        self._runs: queue.SimpleQueue[tuple[list[BlockHash], float] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        # (block hash, has a file or None: skipped, when it was asked): under the lock
        self._answers: list[tuple[BlockHash, bool | None, float]] = []
        # hashes asked about and not answered yet -> when (the scheduler's thread only)
        self.pending: dict[BlockHash, float] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def ask(self, run: Sequence[BlockHash]) -> None:
        """Find out which of ``run`` have files: in order within each piece of it,
        up to the piece's first block that has none (those after it in the piece
        are answered "skipped")."""
        run = [block_hash for block_hash in run if block_hash not in self.pending]
        if not run or self._stopping:
            return
        now = time.monotonic()
        self.pending.update(dict.fromkeys(run, now))
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"heron-kv-disk-probe-{number}", daemon=True)
                             for number in range(PROBE_THREADS)]
            for thread in self._threads:
                thread.start()
        # a long run in parallel pieces, each up to its own first missing block:
        # a prompt's lookup takes a quarter of the round trips one after another
        # (at the cost of a stat or two past a missing block)
        piece = max(MIN_PIECE, -(-len(run) // PROBE_THREADS))
        for start in range(0, len(run), piece):
            self._runs.put((run[start:start + piece], now))

    def timed_out(self, block_hash: BlockHash, now: float) -> bool:
        """``block_hash`` has been pending past ``LOOKUP_TIMEOUT_S``."""
        asked = self.pending.get(block_hash)
        return asked is not None and now - asked > LOOKUP_TIMEOUT_S

    def take_answers(self) -> list[tuple[BlockHash, bool | None, float]]:
        """The answers since the last call: (block hash, has a file, or None: not
        checked, since a block before it in its run has none; when it was asked)."""
        with self._lock:
            answers, self._answers = self._answers, []
        for block_hash, _, _ in answers:
            self.pending.pop(block_hash, None)
        return answers

    def wait(self, timeout: float) -> None:
        """Until an answer is there to take (or ``timeout`` seconds pass): the
        step loop's pause while its only waiting requests wait for this prober."""
        with self._answered:
            if not self._answers:
                self._answered.wait(timeout)

    def close(self) -> None:
        """Stop at once: runs not started are dropped, a stat under way finishes on
        its own (the threads are daemons: one stuck on a hung mount is left)."""
        self._stopping = True
        with contextlib.suppress(queue.Empty):
            while True:
                self._runs.get_nowait()
        for _ in self._threads:
            self._runs.put(_STOP)
        self._threads = []

    def _work(self) -> None:
        while (item := self._runs.get()) is not _STOP:
            run, asked = item
            present = True
            for block_hash in run:
                answer: bool | None = None
                if present and not self._stopping:
                    present = answer = has_file(self.layout, block_hash)
                with self._answered:
                    self._answers.append((block_hash, answer, asked))
                    self._answered.notify_all()


def has_file(layout: DiskTierLayout, block_hash: BlockHash) -> bool:
    """Whether ``block_hash`` has a file (an unreachable file server: no, so the
    prefix is recomputed, never a crash)."""
    try:
        return layout.path_for(block_hash).is_file()
    except OSError:
        return False


def timed_is_file(layout: DiskTierLayout, block_hash: BlockHash) -> tuple[bool, float]:
    """``has_file``, and the seconds the ``stat`` took."""
    started = time.perf_counter()
    present = has_file(layout, block_hash)
    return present, time.perf_counter() - started
