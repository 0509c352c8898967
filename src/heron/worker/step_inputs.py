"""One step's flat batch as the model runner builds it from the scheduler's
output: input ids, positions and slots of every scheduled token of every
request, with the rows that sample and the ids still on the device (async
scheduling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from heron.attention.backend import BatchLayout, flat_batch_layout
from heron.core.scheduler_output import SchedulerOutput
from heron.worker.block_table import BlockTableRows
from heron.worker.request_state import CachedRequestState


def on_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list or a numpy array) as a device tensor. The copy does not
    wait for the device: a blocking host-to-device copy waits for all queued
    device work, which would stall async scheduling's overlap."""
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(device=device, dtype=dtype, non_blocking=True)
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass(frozen=True)
class PendingInputIds:
    """Input ids sampled by the step still in flight, on the device (async
    scheduling): ``token_ids[i]`` goes to flat position ``positions[i]``, or to
    position ``i`` when ``positions`` is None: the common case of a decode batch in
    the same order as the step before, which needs no index copied to the device."""

    token_ids: torch.Tensor
    positions: torch.Tensor | None = None

    def write_into(self, input_ids: torch.Tensor) -> None:
        if self.positions is None:
            input_ids[: self.token_ids.shape[0]].copy_(self.token_ids)
        else:
            input_ids.index_copy_(0, self.positions, self.token_ids)


@dataclass
class StepInputs:
    """One step's flat batch, in batch order (the scheduler's order)."""

    request_ids: list[str]
    states: list[CachedRequestState]
    num_scheduled: np.ndarray  # [B] tokens per request this step
    num_computed: np.ndarray  # [B] tokens cached before this step
    query_start_loc: np.ndarray  # [B + 1]
    sample_rows: list[int]  # requests whose last scheduled token is their last token
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    layout: BatchLayout
    use_graph: bool  # replay a captured CUDA graph for this step
    drafts: list[list[int]]  # [B] draft tokens each request verifies this step
    # async scheduling: flat positions whose input id is the previous step's
    # sampled token (still on the device), and that token's row in its output
    pending_positions: list[int]
    pending_rows: list[int]

    @cached_property
    def logits_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The flat token positions whose logits are needed (each sample row's
        last token, preceded by one per draft it verifies), and the offsets of
        each sample row's logits rows in that list (``[len(sample_rows) + 1]``).
        Computed once a step: the model's last layer (``output_rows``) and the
        logits selection both read it."""
        sample_rows = np.asarray(self.sample_rows, dtype=np.int64)
        if not any(self.drafts):  # one logits row per sample row, its last token
            return self.query_start_loc[1:][sample_rows] - 1, np.arange(len(sample_rows) + 1, dtype=np.int64)
        counts = np.fromiter(
            (len(self.drafts[row]) + 1 for row in self.sample_rows), dtype=np.int64, count=len(sample_rows)
        )
        offsets = np.zeros(len(sample_rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ends = self.query_start_loc[1:][sample_rows]
        index = np.repeat(ends - counts - offsets[:-1], counts) + np.arange(int(offsets[-1]))
        return index, offsets


def build_step_inputs(
    scheduler_output: SchedulerOutput,
    requests: dict[str, CachedRequestState],
    block_rows: BlockTableRows,
    *,
    block_size: int,
    device: torch.device,
    last_sampled_rows: dict[str, int],
    graph_fits: Callable[[int], bool] | None,
) -> StepInputs:
    """The flat batch of the scheduled tokens. ``last_sampled_rows``: each
    request's row in the output of the step in flight (async scheduling);
    ``graph_fits``: whether a captured CUDA graph holds a decode batch of that
    many requests (None: no graphs)."""
    request_ids = list(scheduler_output.num_scheduled_tokens)
    states = [requests[request_id] for request_id in request_ids]
    num_scheduled = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(states))
    num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
    block_table = block_rows.gather(np.fromiter((s.block_row for s in states), dtype=np.int64, count=len(states)))
    layout, positions = flat_batch_layout(num_computed, num_scheduled, block_table, block_size, device=None)
    query_start_loc = layout.query_start_loc
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    drafts = [spec_tokens.get(request_id, []) for request_id in request_ids]
    tokens = _gather_tokens(states, num_computed, num_scheduled, query_start_loc, drafts, last_sampled_rows)
    # a CUDA graph replays decode-only steps where every request samples (no
    # mid-prompt chunk needing prompt logprobs) and the batch fits a bucket
    use_graph = (
        graph_fits is not None
        and bool((num_scheduled == 1).all())
        and len(tokens.sample_rows) == len(states)
        and graph_fits(len(states))
    )
    if not use_graph:  # (the graph runner stages its own copy of the host array)
        assert layout.host_slot_mapping is not None
        layout.slot_mapping = on_device(layout.host_slot_mapping, torch.int64, device)
    return StepInputs(
        request_ids=request_ids,
        states=states,
        num_scheduled=num_scheduled,
        num_computed=num_computed,
        query_start_loc=query_start_loc,
        sample_rows=tokens.sample_rows,
        input_ids=tokens.input_ids,
        positions=positions,
        layout=layout,
        use_graph=use_graph,
        drafts=drafts,
        pending_positions=tokens.pending_positions,
        pending_rows=tokens.pending_rows,
    )


@dataclass
class _GatheredTokens:
    input_ids: np.ndarray
    sample_rows: list[int]
    pending_positions: list[int]
    pending_rows: list[int]


def _gather_tokens(
    states: list[CachedRequestState],
    num_computed: np.ndarray,
    num_scheduled: np.ndarray,
    query_start_loc: np.ndarray,
    drafts: list[list[int]],
    last_sampled_rows: dict[str, int],
) -> _GatheredTokens:
    """Each request's scheduled tokens: positions ``[start, end)`` of its token
    ids followed by its drafts; a last token not on the host yet (sampled by the
    step in flight) is a placeholder filled on the device."""
    gathered = _GatheredTokens(np.empty(int(query_start_loc[-1]), dtype=np.int64), [], [], [])
    input_ids = gathered.input_ids
    starts, offsets = num_computed.tolist(), query_start_loc.tolist()
    for row, (state, count) in enumerate(zip(states, num_scheduled.tolist())):
        start, offset = starts[row], offsets[row]
        end = start + count
        token_ids = state.token_ids
        if count == 1 and start < len(token_ids):  # a decode
            input_ids[offset] = token_ids[start]
            known = end
        else:
            draft = drafts[row]
            assert start <= len(token_ids) + len(draft), state.request_id
            tokens = token_ids[start:end]
            if draft and end > len(token_ids):
                tokens += draft[max(0, start - len(token_ids)) : end - len(token_ids)]
            known = start + len(tokens)
            input_ids[offset : offset + len(tokens)] = tokens
        if known < end:  # its last token is the step in flight's sample
            assert known + 1 == end and state.num_pending_tokens == 1, state.request_id
            input_ids[offset + count - 1] = 0
            gathered.pending_positions.append(offset + count - 1)
            gathered.pending_rows.append(last_sampled_rows[state.request_id])
        if end >= state.num_tokens:
            gathered.sample_rows.append(row)
    return gathered
