"""The CUDA-graph runner's input staging, on the CPU: after ``stage`` the
tensors a captured graph reads (the ``_metadata`` views and the id/position
buffers) hold exactly this step's batch, padded to its bucket (padded rows
write to the scratch slot and attend to nothing), whatever earlier, larger or
smaller steps left behind. Capture and replay themselves need a GPU
(tests/gpu/test_gpu_model.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from heron.attention.backend import BatchLayout
from heron.worker.cuda_graphs import DecodeGraphRunner, _first_failure, graph_buckets
from heron.worker.step_inputs import PendingInputIds

triton_backend = pytest.importorskip("heron.attention.triton_backend")
if not triton_backend.triton_available():
    pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

BLOCK_SIZE = 16
MAX_BLOCKS = 4
SCRATCH = 10_000


def make_runner() -> DecodeGraphRunner:
    backend = triton_backend.TritonAttentionBackend(2)
    return DecodeGraphRunner(None, backend, max_num_seqs=6, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE,
                             scratch_slot=SCRATCH, device=torch.device("cpu"))


def decode_layout(seq_lens: list[int], first_block: int) -> tuple[BatchLayout, np.ndarray, np.ndarray]:
    """A decode step (one token per request, at position seq_len - 1) with its input ids and positions."""
    num_reqs = len(seq_lens)
    lens = np.array(seq_lens, dtype=np.int64)
    widths = -(-lens // BLOCK_SIZE)
    block_table = np.zeros((num_reqs, int(widths.max())), dtype=np.int32)
    for row, width in enumerate(widths):
        block_table[row, :width] = first_block + 10 * row + np.arange(width)
    positions = lens - 1
    slots = block_table[np.arange(num_reqs), positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    layout = BatchLayout(
        num_reqs=num_reqs, num_tokens=num_reqs, query_start_loc=np.arange(num_reqs + 1, dtype=np.int64),
        seq_lens=lens, block_table=block_table, slot_mapping=torch.empty(0), block_size=BLOCK_SIZE,
        host_slot_mapping=slots,
    )
    input_ids = 100 + np.arange(num_reqs, dtype=np.int64) + first_block
    return layout, input_ids, positions


def check_staged(runner: DecodeGraphRunner, bucket: int, layout: BatchLayout, input_ids, positions) -> None:
    num_reqs = layout.num_reqs
    metadata = runner._metadata(bucket)
    assert runner.input_ids[:num_reqs].tolist() == list(input_ids)
    assert runner.positions[:num_reqs].tolist() == list(positions)
    assert metadata.slot_mapping.tolist() == list(layout.host_slot_mapping) + [SCRATCH] * (bucket - num_reqs)
    assert metadata.seq_lens[:num_reqs].tolist() == list(layout.seq_lens)
    assert metadata.work_seq.tolist() == list(range(num_reqs)) + [-1] * (bucket - num_reqs)
    assert metadata.query_start_loc.tolist() == list(range(bucket + 1))
    width = layout.block_table.shape[1]
    assert torch.equal(metadata.block_table[:num_reqs, :width], torch.from_numpy(layout.block_table))
    # padded rows still index valid embeddings and rotary positions
    assert (runner.input_ids[:bucket] >= 0).all() and (runner.positions[:bucket] >= 0).all()


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(1) == [1]


def test_stage_fills_the_graph_inputs_for_each_bucket():
    runner = make_runner()
    for seq_lens, bucket in (([5, 17, 40], 4), ([33], 1), ([2, 3, 4, 5, 6], 6), ([64, 1], 2)):
        layout, input_ids, positions = decode_layout(seq_lens, first_block=len(seq_lens))
        assert runner.stage(layout, input_ids, positions) == bucket
        check_staged(runner, bucket, layout, input_ids, positions)


def test_stage_applies_the_pending_sampled_ids_last():
    """Async scheduling: ids sampled by the step in flight (on the device)
    replace the host's placeholders, after the host-to-device copy."""
    runner = make_runner()
    layout, input_ids, positions = decode_layout([9, 20, 3], first_block=0)
    runner.stage(layout, input_ids, positions, PendingInputIds(torch.tensor([7, 8])))
    assert runner.input_ids[:3].tolist() == [7, 8, input_ids[2]]
    runner.stage(layout, input_ids, positions, PendingInputIds(torch.tensor([5]), torch.tensor([2])))
    assert runner.input_ids[:3].tolist() == [input_ids[0], input_ids[1], 5]


def _host_read_in_forward() -> None:
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")


def test_a_failed_capture_is_named_by_the_error_it_began_with():
    """Ending a broken capture raises a second error on top of the first; the
    warning names the first one and the line that raised it."""
    try:
        try:
            _host_read_in_forward()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        reason = _first_failure(error)
    line = _host_read_in_forward.__code__.co_firstlineno + 1
    assert reason == f"CUDA error: operation not permitted when stream is capturing at {__file__}:{line}"


def test_the_capture_error_is_named_under_an_error_the_forward_had_handled():
    """A forward that breaks the capture inside an ``except`` (a recompute after a
    cache miss, say) chains the capture error onto the handled one: the warning
    named the handled KeyError."""
    try:
        try:
            try:
                raise KeyError(7)
            except KeyError:
                _host_read_in_forward()
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        reason = _first_failure(error)
    assert reason.startswith("CUDA error: operation not permitted when stream is capturing at "), reason
