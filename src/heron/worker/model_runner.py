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
from typing import Any

import numpy as np
import torch

from heron.attention.backend import BatchLayout, get_attention_backend
from heron.config import EngineConfig
from heron.core.scheduler_output import SchedulerOutput
from heron.models.registry import build_model
from heron.profiling import phase
from heron.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from heron.worker.input_batch import CachedRequestState, build_sampling_metadata
from heron.worker.kv_cache_sizing import kv_cache_bytes_per_block
from heron.worker.runner_output import ModelRunnerOutput, TokenLogprobs

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
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: Any


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
        self.backend = get_attention_backend(self.device)
        self.vocab_size = config.model.vocab_size
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache --------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        spec = self.attention_layers[0].spec
        return kv_cache_bytes_per_block(
            num_layers=len(self.attention_layers),
            block_size=self.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=self.config.model.dtype,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache, zeroed (stale NaNs in padded slots would
        leak through a masked softmax as 0 * NaN), and bind it to its layer."""
        self.kv_caches = []
        for layer in self.attention_layers:
            spec = layer.spec
            shape = self.backend.kv_cache_shape(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            cache = _zeros(shape, self.config.model.dtype, self.device)
            layer.kv_cache = cache
            layer.backend = self.backend
            self.kv_caches.append(cache)

    # ---- one step ----------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState.from_new_request(new, self.device)
        cached = scheduler_output.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[request_id]
            state.block_ids.extend(new_block_ids)
            state.num_computed_tokens = num_computed

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput.empty()
        with phase("prepare_inputs"):
            step = self._prepare_inputs(scheduler_output)
        with phase("forward"):
            hidden = self.model(step.input_ids, step.positions, step.attn_metadata)
        with phase("sample"):
            return self._sample(step, hidden)

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
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
        sample_rows: list[int] = []
        for row, state in enumerate(states):
            start, count = int(num_computed[row]), int(num_scheduled[row])
            offset = int(query_start_loc[row])
            input_ids[offset : offset + count] = state.token_ids[start : start + count]
            block_table[row, : len(state.block_ids)] = state.block_ids
            if start + count >= len(state.token_ids):
                sample_rows.append(row)
        row_of_token = np.repeat(np.arange(len(states)), num_scheduled)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - num_computed, num_scheduled)
        slot_mapping = (
            block_table[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        layout = BatchLayout(
            num_reqs=len(states),
            num_tokens=num_tokens,
            query_start_loc=query_start_loc,
            seq_lens=num_computed + num_scheduled,
            block_table=block_table,
            slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
            block_size=self.block_size,
        )
        return StepInputs(
            request_ids=request_ids,
            states=states,
            num_scheduled=num_scheduled,
            num_computed=num_computed,
            query_start_loc=query_start_loc,
            sample_rows=sample_rows,
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=self.backend.build_metadata(layout),
        )

    def _sample(self, step: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        states = step.states
        prompt_logprobs = self._prompt_logprobs(step, hidden)
        sampled_token_ids: list[list[int]] = [[] for _ in states]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(states)
        if step.sample_rows:
            logits_index = torch.from_numpy(step.query_start_loc[1:][step.sample_rows] - 1).to(self.device)
            logits = self.model.compute_logits(hidden.index_select(0, logits_index))
            sample_states = [states[row] for row in step.sample_rows]
            sampling_metadata = build_sampling_metadata(sample_states, self.vocab_size, self.device)
            output = self.sampler(logits, sampling_metadata)
            sampled = output.sampled_token_ids.tolist()
            row_logprobs = _split_logprobs(output, sample_states)
            for index, row in enumerate(step.sample_rows):
                token_id = sampled[index]
                sampled_token_ids[row] = [token_id]
                states[row].token_ids.append(token_id)
                if row_logprobs[index] is not None:
                    logprobs[row] = [row_logprobs[index]]  # type: ignore[list-item]
        for row, state in enumerate(states):
            state.num_computed_tokens += int(step.num_scheduled[row])
        return ModelRunnerOutput(
            req_ids=step.request_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed memory; on CPU from calloc'ed pages that the kernel zero-fills on first
    touch, so a multi-GiB cache costs nothing until it is used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element_size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * element_size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


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
