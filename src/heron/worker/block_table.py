"""Every live request's block ids as a row of one numpy array.

The scheduler grants blocks as a request grows; the runner appends them to the
request's row as they come. A step's block table is then one gather of its
requests' rows, in C, instead of a Python copy of every request's whole block
list each step (which grows with the context: ~60 ids per request at 1,000
tokens, every step, for every running request).
"""

from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, num_rows: int, width: int) -> None:
        self.table = np.zeros((max(1, num_rows), max(1, width)), dtype=np.int32)
        self.lengths = np.zeros(self.table.shape[0], dtype=np.int64)
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A row for a new request, holding ``block_ids``; returns its index."""
        if not self._free_rows:
            old = self.table.shape[0]
            self._resize(2 * old, self.table.shape[1])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.table[row, : self.lengths[row]] = 0  # padding reads 0, as in a fresh table
        self.lengths[row] = 0
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._resize(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def remove(self, row: int) -> None:
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The block table of a batch: ``rows``' block ids, padded with 0 to the
        longest of them."""
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def _resize(self, num_rows: int, width: int) -> None:
        table = np.zeros((num_rows, width), dtype=np.int32)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        lengths = np.zeros(num_rows, dtype=np.int64)
        lengths[: self.lengths.shape[0]] = self.lengths
        self.table, self.lengths = table, lengths
