"""The model runner: loads the model, owns the KV cache, and executes one step.

A step turns the scheduler's decision into a flat batch (``input_ids[T]``,
``positions[T]``, ``slot_mapping[T]``, per-request query offsets, context lengths
and block tables), runs the model once over it, computes logits only at the
positions that will be sampled, and samples them in one batched call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from heron.attention.backend import BatchLayout, get_attention_backend, positions_and_slots
from heron.config import EngineConfig
from heron.core.scheduler_output import SchedulerOutput
from heron.models.registry import build_model
from heron.profiling import phase
from heron.sample.rejection import RejectionSampler
from heron.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from heron.spec_decode.proposer import DraftProposer, build_proposer
from heron.worker.block_table import BlockTableRows
from heron.worker.compute_path import describe_compute_path, format_compute_path
from heron.worker.input_batch import CachedRequestState, PendingInputIds, SamplingMetadataBuilder, on_device
from heron.worker.kv_cache_sizing import bind_kv_caches, layers_bytes_per_block
from heron.worker.runner_output import ModelRunnerOutput, PendingRunnerOutput, TokenLogprobs
from heron.worker.spec_verify import verify_drafts

logger = logging.getLogger(__name__)


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

    def logits_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The flat token positions whose logits are needed (each sample row's
        last token, preceded by one per draft it verifies), and the offsets of
        each sample row's logits rows in that list (``[len(sample_rows) + 1]``)."""
        sample_rows = np.asarray(self.sample_rows, dtype=np.int64)
        if not any(self.drafts):  # one logits row per sample row, its last token
            return self.query_start_loc[1:][sample_rows] - 1, np.arange(len(sample_rows) + 1, dtype=np.int64)
        counts = np.fromiter((len(self.drafts[row]) + 1 for row in self.sample_rows), dtype=np.int64, count=len(sample_rows))
        offsets = np.zeros(len(sample_rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ends = self.query_start_loc[1:][sample_rows]
        index = np.repeat(ends - counts - offsets[:-1], counts) + np.arange(int(offsets[-1]))
        return index, offsets


@dataclass
class StructuredStep:
    """The grammar bitmask of this step's structured requests (in
    ``request_ids`` order, one row per logits row of each: 1 + its drafts) and
    how to apply it to logits rows."""

    request_ids: list[str]
    bitmask: Any
    apply: Callable[[torch.Tensor, Any, list[int]], None]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        started = time.perf_counter()
        self.model = build_model(config.model, self.device)
        logger.info(
            "loaded %s (%s, %s) in %.1f s",
            config.model.served_model_name,
            config.model.architecture,
            str(config.model.dtype).removeprefix("torch."),
            time.perf_counter() - started,
        )
        self.attention_layers = self.model.attention_layers()
        spec = self.attention_layers[0].spec
        self.backend = get_attention_backend(self.device, spec.num_heads, spec.num_kv_heads, config.attention_backend)
        self.compute_path = describe_compute_path(config, self.model, self.backend.name, self.use_cuda_graphs)
        logger.info("compute path: %s", format_compute_path(self.compute_path))
        self.vocab_size = config.model.vocab_size
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.sampling_metadata = SamplingMetadataBuilder(self.vocab_size, self.device)
        self.rejection_sampler = RejectionSampler(generator)
        self.proposer: DraftProposer | None = build_proposer(config, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.block_rows = BlockTableRows(
            config.scheduler.max_num_seqs, -(-config.model.max_model_len // config.cache.block_size)
        )
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: Any = None  # a cuda_graphs.DecodeGraphRunner on CUDA
        # the last deferred step's sampled ids (on the device) and each request's row
        self._last_sampled: torch.Tensor | None = None
        self._last_sampled_rows: dict[str, int] = {}
        if config.compile_model:
            self.model.forward = torch.compile(self.model.forward, dynamic=True)

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and self.backend.name == "triton" and not self.config.enforce_eager

    # ---- KV cache --------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block in every layer's cache (and the draft model's)."""
        target = layers_bytes_per_block(self.attention_layers, self.block_size, self.config.model.dtype)
        return target + (self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache, zeroed (stale NaNs in padded slots would
        leak through a masked softmax as 0 * NaN), and bind it to its layer. With
        CUDA graphs, one extra block past the pool is the padded rows' scratch."""
        num_allocated = num_blocks + (1 if self.use_cuda_graphs else 0)
        self._bind_kv_caches(num_allocated)
        if self.proposer is not None:
            self.proposer.bind_kv_caches(num_allocated)
        if self.use_cuda_graphs:
            from heron.worker.cuda_graphs import DecodeGraphRunner

            self.decode_graphs = DecodeGraphRunner(
                self.model,
                self.backend,
                max_num_seqs=self.config.scheduler.max_num_seqs,
                max_blocks_per_seq=-(-self.config.model.max_model_len // self.block_size),
                block_size=self.block_size,
                scratch_slot=num_blocks * self.block_size,
                device=self.device,
            )
            self.decode_graphs.capture()

    def _bind_kv_caches(self, num_blocks: int) -> None:
        self.kv_caches = bind_kv_caches(
            self.attention_layers, self.backend, num_blocks, self.block_size, self.config.model.dtype, self.device
        )

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_seqs: int) -> int:
        """Run a worst-case step (``num_tokens`` prompt tokens over ``num_seqs``
        requests, logits and top-p sampling for all of them) and return the peak
        activation memory it needed, in bytes (CUDA)."""
        max_len = self.config.model.max_model_len - 1
        num_seqs = max(1, min(num_seqs, num_tokens))
        lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        lengths = [min(length, max_len) for length in lengths if length > 0]
        blocks_needed = sum(-(-length // self.block_size) for length in lengths)
        self._bind_kv_caches(blocks_needed)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        query_start_loc = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        block_table = np.zeros((len(lengths), max(-(-n // self.block_size) for n in lengths)), dtype=np.int32)
        cursor = 0
        for row, length in enumerate(lengths):
            count = -(-length // self.block_size)
            block_table[row, :count] = np.arange(cursor, cursor + count)
            cursor += count
        positions = np.concatenate([np.arange(n) for n in lengths])
        rows = np.repeat(np.arange(len(lengths)), lengths)
        slots = block_table[rows, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        layout = BatchLayout(len(lengths), total, query_start_loc, np.array(lengths, dtype=np.int64), block_table,
                             torch.from_numpy(slots).to(self.device), self.block_size)
        hidden = self.model(
            torch.zeros(total, dtype=torch.int64, device=self.device),
            torch.from_numpy(positions).to(self.device),
            self.backend.build_metadata(layout),
        )
        rows_to_sample = self.config.scheduler.max_num_seqs
        logits = self.model.compute_logits(hidden[:1].expand(rows_to_sample, -1).contiguous())
        probs = torch.softmax(logits, dim=-1)
        probs.sort(dim=-1, descending=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        del hidden, logits, probs
        for layer in self.attention_layers:
            layer.kv_cache = None
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak)

    # ---- one step ----------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.block_rows.remove(state.block_row)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self._forget(request_id)
            if self.proposer is not None:
                self.proposer.remove_request(request_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._forget(new.request_id)
            state = CachedRequestState.from_new_request(new, self.device)
            state.block_row = self.block_rows.add(state.block_ids)
            self.requests[new.request_id] = state
            if self.proposer is not None:
                self.proposer.add_request(new.request_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[request_id]
            if new_block_ids:
                state.block_ids.extend(new_block_ids)
                self.block_rows.extend(state.block_row, new_block_ids)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        structured: StructuredStep | None = None,
        defer_output: bool = False,
    ) -> ModelRunnerOutput | PendingRunnerOutput:
        """Run one step. With ``defer_output`` (async scheduling) a step that
        samples returns as soon as its work is queued on the device: the sampled
        ids are copied back in the background and the next step may use them as
        input ids on the device before the host has seen them."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput.empty()
        with phase("prepare_inputs"):
            step = self._prepare_inputs(scheduler_output)
            pending = self._pending_token_ids(step)
        if step.use_graph:
            assert self.decode_graphs is not None
            with phase("forward"):
                logits = self.decode_graphs.run(step.layout, step.input_ids, step.positions, pending)
            with phase("sample"):
                return self._sample(step, None, logits, structured, defer_output)
        with phase("forward"):
            input_ids = on_device(step.input_ids, torch.int64, self.device)
            if pending is not None:
                pending.write_into(input_ids)
            hidden = self.model(
                input_ids,
                on_device(step.positions, torch.int64, self.device),
                self.backend.build_metadata(step.layout),
            )
        with phase("sample"):
            return self._sample(step, hidden, None, structured, defer_output)

    def _pending_token_ids(self, step: StepInputs) -> PendingInputIds | None:
        """The input ids sampled by the step in flight, with their flat positions,
        all on the device: no wait for that step."""
        if not step.pending_positions:
            return None
        assert self._last_sampled is not None
        count = len(step.pending_rows)
        if step.pending_rows == step.pending_positions == list(range(count)):
            return PendingInputIds(self._last_sampled[:count])  # the same decodes, in the same order
        rows = on_device(step.pending_rows, torch.int64, self.device)
        positions = on_device(step.pending_positions, torch.int64, self.device)
        return PendingInputIds(self._last_sampled.index_select(0, rows), positions)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        request_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[request_id] for request_id in request_ids]
        num_scheduled = np.fromiter(
            scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(request_ids)
        )
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))

        input_ids = np.empty(num_tokens, dtype=np.int64)
        block_table = self.block_rows.gather(
            np.fromiter((s.block_row for s in states), dtype=np.int64, count=len(states))
        )
        sample_rows: list[int] = []
        pending_positions: list[int] = []
        pending_rows: list[int] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec_tokens.get(request_id, []) for request_id in request_ids]
        starts, offsets = num_computed.tolist(), query_start_loc.tolist()
        for row, (state, count) in enumerate(zip(states, num_scheduled.tolist())):
            start, offset = starts[row], offsets[row]
            end = start + count
            # this step's tokens: positions [start, end) of token_ids + drafts
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
                pending_positions.append(offset + count - 1)
                pending_rows.append(self._last_sampled_rows[state.request_id])
            if end >= state.num_tokens:
                sample_rows.append(row)
        positions, slot_mapping = positions_and_slots(
            query_start_loc, num_computed, num_scheduled, block_table, self.block_size
        )
        # a CUDA graph replays decode-only steps where every request samples (no
        # mid-prompt chunk needing prompt logprobs) and the batch fits a bucket
        use_graph = (
            self.decode_graphs is not None
            and bool((num_scheduled == 1).all())
            and len(sample_rows) == len(states)
            and self.decode_graphs.bucket_for(len(states)) is not None
        )
        layout = BatchLayout(
            num_reqs=len(states),
            num_tokens=num_tokens,
            query_start_loc=query_start_loc,
            seq_lens=num_computed + num_scheduled,
            block_table=block_table,
            # the graph runner stages its own copy of the host array
            slot_mapping=torch.empty(0) if use_graph else on_device(slot_mapping, torch.int64, self.device),
            block_size=self.block_size,
            host_slot_mapping=slot_mapping,
        )
        return StepInputs(
            request_ids=request_ids,
            states=states,
            num_scheduled=num_scheduled,
            num_computed=num_computed,
            query_start_loc=query_start_loc,
            sample_rows=sample_rows,
            input_ids=input_ids,
            positions=positions,
            layout=layout,
            use_graph=use_graph,
            drafts=drafts,
            pending_positions=pending_positions,
            pending_rows=pending_rows,
        )

    def _sample(
        self,
        step: StepInputs,
        hidden: torch.Tensor | None,
        decode_logits: torch.Tensor | None,
        structured: StructuredStep | None = None,
        defer_output: bool = False,
    ) -> ModelRunnerOutput | PendingRunnerOutput:
        """Sample the rows that reached their last token. Either ``hidden`` (all
        tokens) or ``decode_logits`` (one row per request, from a CUDA graph) is given."""
        states = step.states
        prompt_logprobs = self._prompt_logprobs(step, hidden) if hidden is not None else {}
        sampled_token_ids: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(states)
        if step.sample_rows:
            if decode_logits is not None:  # one token per request: no drafts
                offsets = np.arange(len(step.sample_rows) + 1, dtype=np.int64)
                if len(step.sample_rows) == len(states):
                    logits = decode_logits
                else:
                    logits = decode_logits[on_device(step.sample_rows, torch.int64, self.device)]
            else:
                assert hidden is not None
                index, offsets = step.logits_rows()
                logits = self.model.compute_logits(hidden.index_select(0, on_device(index, torch.int64, self.device)))
            if structured is not None:
                position = {step.request_ids[row]: i for i, row in enumerate(step.sample_rows)}
                members = [position[request_id] for request_id in structured.request_ids]
                structured.apply(logits, structured.bitmask, _logits_rows_of(offsets, members).tolist())
            plain = [i for i, row in enumerate(step.sample_rows) if not step.drafts[row]]
            spec = [i for i, row in enumerate(step.sample_rows) if step.drafts[row]]
            if plain:
                plain_logits = logits if not spec else logits[on_device(offsets[plain], torch.int64, self.device)]
                plain_states = [states[step.sample_rows[i]] for i in plain]
                output = self.sampler(plain_logits, self.sampling_metadata.build(plain_states))
                if defer_output:
                    assert not spec, "async scheduling does not verify drafts"
                    return self._defer_output(step, output, plain_states, prompt_logprobs)
                row_logprobs = _split_logprobs(output, plain_states)
                for i, token_id, entry in zip(plain, output.sampled_token_ids.tolist(), row_logprobs):
                    row = step.sample_rows[i]
                    sampled_token_ids[row] = [token_id]
                    if entry is not None:
                        logprobs[row] = [entry]
            if spec:
                spec_rows = [step.sample_rows[i] for i in spec]
                tokens, spec_logprobs = verify_drafts(
                    self.rejection_sampler,
                    logits[on_device(_logits_rows_of(offsets, spec), torch.int64, self.device)],
                    [states[row] for row in spec_rows],
                    [step.drafts[row] for row in spec_rows],
                    self.vocab_size,
                    self.device,
                )
                for row, emitted, entry in zip(spec_rows, tokens, spec_logprobs):
                    sampled_token_ids[row] = emitted
                    logprobs[row] = entry
            for row in step.sample_rows:
                states[row].token_ids.extend(sampled_token_ids[row])
        for row, state in enumerate(states):
            # rejected drafts' K/V will be overwritten: they do not count as computed
            num_rejected = len(step.drafts[row]) + 1 - len(sampled_token_ids[row]) if step.drafts[row] else 0
            state.num_computed_tokens += int(step.num_scheduled[row]) - num_rejected
        draft_token_ids = {}
        if self.proposer is not None:
            with phase("propose"):
                sampled = [bool(tokens) for tokens in sampled_token_ids]
                draft_token_ids = self.proposer.propose(states, sampled)
        return ModelRunnerOutput(
            req_ids=step.request_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=draft_token_ids,
        )

    def _defer_output(
        self,
        step: StepInputs,
        output: SamplerOutput,
        sampled_states: list[CachedRequestState],
        prompt_logprobs: dict[str, list[TokenLogprobs]],
    ) -> PendingRunnerOutput:
        """Start copying this step's samples to the host and return at once; the
        states count the tokens as pending until ``get()`` appends them."""
        for row, state in enumerate(step.states):
            state.num_computed_tokens += int(step.num_scheduled[row])
        for state in sampled_states:
            state.num_pending_tokens += 1
        self._last_sampled = output.sampled_token_ids
        self._last_sampled_rows = {state.request_id: i for i, state in enumerate(sampled_states)}
        host = SamplerOutput(*(
            None if tensor is None else tensor.to("cpu", non_blocking=True)  # pinned, in stream order
            for tensor in (output.sampled_token_ids, output.logprob_token_ids, output.logprobs, output.sampled_ranks)
        ))
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        if copied is not None:
            copied.record()

        def resolve() -> ModelRunnerOutput:
            if copied is not None:
                copied.synchronize()  # this step's copy only, not the steps queued since
            token_ids = host.sampled_token_ids.tolist()
            entries = _split_logprobs(host, sampled_states)
            sampled: list[list[int]] = [[] for _ in step.states]
            logprobs: list[list[TokenLogprobs] | None] = [None] * len(step.states)
            for row, state, token_id, entry in zip(step.sample_rows, sampled_states, token_ids, entries):
                state.token_ids.append(token_id)
                state.num_pending_tokens -= 1
                sampled[row] = [token_id]
                logprobs[row] = None if entry is None else [entry]
            return ModelRunnerOutput(step.request_ids, sampled, logprobs, prompt_logprobs)

        return PendingRunnerOutput(resolve)

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens whose predecessors were computed this step:
        the hidden state at position p scores prompt token p + 1."""
        result: dict[str, list[TokenLogprobs]] = {}
        for row, state in enumerate(step.states):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            start = int(step.num_computed[row])
            end = min(start + int(step.num_scheduled[row]), state.num_prompt_tokens - 1)
            if end <= start:
                continue
            offset = int(step.query_start_loc[row])
            logits = self.model.compute_logits(hidden[offset : offset + end - start])
            targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
            gathered = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, num_top)
            result[state.request_id] = _to_token_logprobs(gathered, num_top)
        return result


def _logits_rows_of(offsets: np.ndarray, members: list[int]) -> np.ndarray:
    """The logits rows of the given sample rows (``offsets`` from
    ``StepInputs.logits_rows``), in order."""
    return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])


def _to_token_logprobs(output: SamplerOutput, num_top: int) -> list[TokenLogprobs]:
    assert output.logprob_token_ids is not None and output.logprobs is not None
    assert output.sampled_ranks is not None
    token_ids = output.logprob_token_ids[:, : num_top + 1].tolist()
    values = output.logprobs[:, : num_top + 1].tolist()
    ranks = output.sampled_ranks.tolist()
    return [TokenLogprobs(ids, vals, rank) for ids, vals, rank in zip(token_ids, values, ranks)]


def _split_logprobs(output: SamplerOutput, states: list[CachedRequestState]) -> list[TokenLogprobs | None]:
    if output.logprob_token_ids is None:
        return [None] * len(states)
    all_rows = _to_token_logprobs(output, output.logprob_token_ids.shape[1] - 1)
    result: list[TokenLogprobs | None] = []
    for state, entry in zip(states, all_rows):
        num_top = state.sampling_params.logprobs
        if num_top is None:
            result.append(None)
        else:
            result.append(TokenLogprobs(entry.token_ids[: num_top + 1], entry.logprobs[: num_top + 1], entry.rank))
    return result
