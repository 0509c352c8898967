"""CUDA-graph replay of decode steps.

At start, the model's forward pass plus the LM head is captured once per batch
bucket (1, 2, 4, ..., max_num_seqs) over persistent device buffers. A decode-only
step (every request schedules one token) with ``B`` requests fills the buffers,
pads to the smallest bucket ``>= B`` (padded rows write their K/V into a scratch
slot past the end of the pool and attend to nothing), replays the graph, and keeps
the first ``B`` rows of the logits. Graphs remove the per-kernel launch cost that
dominates small decode batches.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import numpy as np
import torch

from heron.attention.backend import BatchLayout
from heron.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
from heron.worker.step_inputs import PendingInputIds

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    buckets = []
    size = 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_seqs)
    return buckets


class DecodeGraphRunner:
    def __init__(
        self,
        model: Any,
        backend: TritonAttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.buckets = graph_buckets(max_num_seqs)
        self.scratch_slot = scratch_slot
        size = self.buckets[-1]
        self.size = size
        self.max_blocks_per_seq = max_blocks_per_seq
        # The graphs' inputs are views of two device tensors, each filled by one
        # host-to-device copy per step from pinned staging of the same layout: int64
        # rows (input ids, positions, slots) and int32 ones (seq lens, work list,
        # then the block table)
        self._device_ids = torch.zeros(3 * size, dtype=torch.int64, device=device)
        self._device_meta = torch.zeros(2 * size + size * max_blocks_per_seq, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._device_ids.view(3, size)
        self.seq_lens, self.work_seq = self._device_meta[: 2 * size].view(2, size)
        self.block_table = self._device_meta[2 * size :].view(size, max_blocks_per_seq)
        self.slot_mapping.fill_(scratch_slot)
        self.work_seq.fill_(-1)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.work_q = torch.zeros(size, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # two staging sets, alternating: with async scheduling the host fills step
        # N+1's while step N's copy may still be queued (step N-1's has run: the
        # host waited for its output). Zeroed: a padded row's id and position are
        # whatever an earlier step left there, always valid indices
        pin = device.type == "cuda"
        self._staging = [
            (torch.zeros(3 * size, dtype=torch.int64, pin_memory=pin),
             torch.zeros(self._device_meta.shape[0], dtype=torch.int32, pin_memory=pin))
            for _ in range(2)
        ]
        self._next_staging = 0

    def _metadata(self, bucket: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_table=self.block_table[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            work_seq=self.work_seq[:bucket],
            work_q=self.work_q[:bucket],
            block_q=self.backend.block_q(1),
            block_size=self.block_size,
            max_kv_splits=self.backend.max_kv_splits,
            num_sms=self.backend.num_sms(self.input_ids.device),
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self._metadata(bucket))
        return self.model.compute_logits(hidden)

    def _capture_bucket(self, bucket: int, pool: Any, stream: torch.cuda.Stream) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = self._forward(bucket)
        return graph, logits

    @torch.inference_mode()
    def capture(self) -> str | None:
        """Capture every bucket's graph. Returns None, or why the model cannot be
        captured: then nothing is, and its decode steps run eagerly. A forward that
        waits for the device (a branch on a device value, a shape that depends on
        the data such as transformers' MoE loops over the experts hit) fails its
        capture. (A dry run under CUDA's sync debug mode is no test: transformers
        skips some of its checks only while a stream is capturing.)"""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        reason = None
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):  # largest first: later ones reuse its pool
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels)
                    self._forward(bucket)
                try:
                    self.graphs[bucket] = self._capture_bucket(bucket, pool, stream)
                except RuntimeError as error:
                    if self.graphs:  # the forward was captured once: something else is wrong
                        raise
                    reason = _first_failure(error)
                    break
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        if reason is None:
            logger.info("captured CUDA graphs for decode batches %s in %.1f s", self.buckets,
                        time.perf_counter() - started)
        return reason

    def bucket_for(self, num_reqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_reqs), None)

    def stage(
        self,
        layout: BatchLayout,
        input_ids: np.ndarray,
        positions: np.ndarray,
        pending: PendingInputIds | None = None,
    ) -> int:
        """Fill the graphs' inputs for a decode-only batch (two host-to-device
        copies, plus the pending ids' device copy) and return its bucket."""
        num_reqs = layout.num_reqs
        bucket = self.bucket_for(num_reqs)
        assert bucket is not None
        size = self.size
        staging_ids, staging_meta = self._staging[self._next_staging]
        self._next_staging ^= 1
        ids = staging_ids.numpy().reshape(3, size)
        ids[0, :num_reqs] = input_ids
        ids[1, :num_reqs] = positions
        ids[2, :num_reqs] = layout.host_slot_mapping
        ids[2, num_reqs:bucket] = self.scratch_slot  # padded rows write their K/V there
        meta = staging_meta.numpy()
        meta[:num_reqs] = layout.seq_lens
        meta[size : size + bucket] = -1  # padded rows attend to nothing
        meta[size : size + num_reqs] = np.arange(num_reqs)
        width = layout.block_table.shape[1]
        meta[2 * size :].reshape(size, self.max_blocks_per_seq)[:num_reqs, :width] = layout.block_table
        self._device_ids.copy_(staging_ids, non_blocking=True)
        used = 2 * size + num_reqs * self.max_blocks_per_seq
        self._device_meta[:used].copy_(staging_meta[:used], non_blocking=True)
        if pending is not None:
            pending.write_into(self.input_ids)
        return bucket

    def run(
        self,
        layout: BatchLayout,
        input_ids: np.ndarray,
        positions: np.ndarray,
        pending: PendingInputIds | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode-only batch of ``B`` requests;
        ``pending`` (token ids on the device) overrides some of those input ids."""
        bucket = self.stage(layout, input_ids, positions, pending)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[: layout.num_reqs]


def _first_failure(error: BaseException) -> str:
    """The error a failed capture began with (ending the capture raises another on
    top of it) as one line, with the Python line that raised it: the deepest
    error that speaks of the capture (one handled by the code it broke may lie
    under it), else the deepest."""
    chain = [error]
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    error = next((e for e in reversed(chain) if "captur" in str(e).lower()), chain[-1])
    message = (str(error).strip().splitlines() or [type(error).__name__])[0]
    frames = traceback.extract_tb(error.__traceback__)
    return f"{message} at {frames[-1].filename}:{frames[-1].lineno}" if frames else message
