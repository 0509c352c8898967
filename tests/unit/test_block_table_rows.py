"""The runner's persistent block table: rows grow as blocks are granted, are
reused after a request leaves (padding reads 0 again), and the table grows in
both directions when it must."""

from __future__ import annotations

import numpy as np

from heron.worker.block_table import BlockTableRows


def test_rows_gather_into_a_zero_padded_block_table():
    rows = BlockTableRows(num_rows=2, width=2)
    a = rows.add([5, 6])
    b = rows.add([7])
    rows.extend(b, [8, 9, 10])  # wider than the table: it widens
    rows.extend(a, [])
    assert rows.gather(np.array([b, a])).tolist() == [[7, 8, 9, 10], [5, 6, 0, 0]]
    c = rows.add([1])  # more rows than the table had: it grows
    assert rows.gather(np.array([c])).tolist() == [[1]]
    assert rows.gather(np.array([a, c])).tolist() == [[5, 6], [1, 0]]


def test_a_reused_row_starts_empty():
    rows = BlockTableRows(num_rows=1, width=4)
    first = rows.add([3, 4, 5])
    rows.remove(first)
    second = rows.add([9])
    assert second == first
    assert rows.gather(np.array([second, second])).tolist() == [[9], [9]]
    rows.extend(second, [2])
    assert rows.table[second].tolist() == [9, 2, 0, 0]
