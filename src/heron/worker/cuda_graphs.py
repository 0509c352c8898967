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
from typing import Any

import numpy as np
import torch

from heron.attention.backend import BatchLayout
from heron.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata
from heron.worker.input_batch import PendingInputIds

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
        size = self.buckets[-1]
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), scratch_slot, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((size, max_blocks_per_seq), **int32)
        self.seq_lens = torch.zeros(size, **int32)
        self.query_start_loc = torch.arange(size + 1, **int32)
        self.work_seq = torch.full((size,), -1, **int32)
        self.work_q = torch.zeros(size, **int32)
        self.scratch_slot = scratch_slot
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # pinned staging per step: ids, positions, slots, seq lens, work list; and the
        # block table. Two sets, alternating: with async scheduling the host fills
        # step N+1's while step N's copy may still be queued (step N-1's has run:
        # the host waited for its output)
        self._staging = [torch.empty(5 * size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._staging_blocks = [
            torch.empty((size, max_blocks_per_seq), dtype=torch.int32, pin_memory=True) for _ in range(2)
        ]
        self._next_staging = 0
        self._device_staging = torch.empty(5 * size, dtype=torch.int64, device=device)

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

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):  # largest first: later ones reuse its pool
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels)
                    self._forward(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(bucket)
                self.graphs[bucket] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches %s in %.1f s", self.buckets, time.perf_counter() - started)

    def bucket_for(self, num_reqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_reqs), None)

    def run(
        self,
        layout: BatchLayout,
        input_ids: np.ndarray,
        positions: np.ndarray,
        pending: PendingInputIds | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode-only batch of ``B`` requests;
        ``pending`` (token ids on the device) overrides some of those input ids."""
        num_reqs = layout.num_reqs
        bucket = self.bucket_for(num_reqs)
        assert bucket is not None
        staging, staging_blocks = self._staging[self._next_staging], self._staging_blocks[self._next_staging]
        self._next_staging ^= 1
        # stage every per-row input in pinned memory, then two copies to the device
        staged = staging.numpy().reshape(5, -1)
        staged[0, :num_reqs] = input_ids
        staged[1, :num_reqs] = positions
        staged[2, :num_reqs] = layout.host_slot_mapping
        staged[2, num_reqs:bucket] = self.scratch_slot
        staged[3, :num_reqs] = layout.seq_lens
        staged[4, :bucket] = -1
        staged[4, :num_reqs] = np.arange(num_reqs)
        width = layout.block_table.shape[1]
        staging_blocks.numpy()[:num_reqs, :width] = layout.block_table
        self._device_staging.copy_(staging, non_blocking=True)
        self.block_table[:num_reqs].copy_(staging_blocks[:num_reqs], non_blocking=True)
        device_rows = self._device_staging.view(5, -1)
        self.input_ids[:bucket].copy_(device_rows[0, :bucket])
        if pending is not None:
            pending.write_into(self.input_ids)
        self.positions[:bucket].copy_(device_rows[1, :bucket])
        self.slot_mapping[:bucket].copy_(device_rows[2, :bucket])
        self.seq_lens[:bucket].copy_(device_rows[3, :bucket])
        self.work_seq[:bucket].copy_(device_rows[4, :bucket])
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:num_reqs]
