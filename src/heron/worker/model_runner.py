"""The model runner: loads the model, owns the KV cache, and executes one step.

A step turns the scheduler's decision into a flat batch (``input_ids[T]``,
``positions[T]``, ``slot_mapping[T]``, per-request query offsets, context lengths
and block tables), runs the model once over it, computes logits only at the
positions that will be sampled, and samples them in one batched call.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch

from heron.attention.backend import flat_batch_layout
from heron.attention.registry import get_attention_backend
from heron.config import EngineConfig, KVTransferConfig
from heron.core.hashing import BlockHash
from heron.core.kv_disk_layout import DiskTierLayout
from heron.core.kv_offload import KVTransfers
from heron.core.kv_remote import RemoteLoad
from heron.core.scheduler_output import SchedulerOutput
from heron.interrupts import interrupts_deferred
from heron.models.registry import build_model
from heron.profiling import phase
from heron.sample.rejection import RejectionSampler
from heron.sample.sampler import Sampler, SamplerOutput, gather_logprobs
from heron.spec_decode.proposer import DraftProposer, build_proposer
from heron.step_outputs import ModelRunnerOutput, PendingRunnerOutput, TokenLogprobs
from heron.utils import cdiv
from heron.worker.block_table import BlockTableRows
from heron.worker.compute_path import describe_compute_path, format_compute_path
from heron.worker.kv_cache_sizing import bind_kv_caches, layers_bytes_per_block
from heron.worker.kv_disk_store import DiskKVStore
from heron.worker.kv_load_reports import LoadReports
from heron.worker.kv_offload_store import HostKVStore
from heron.worker.kv_pull import RemoteKVLoader
from heron.worker.kv_transfer import KVBlockServer
from heron.worker.request_state import CachedRequestState
from heron.worker.sampling_metadata import SamplingMetadataBuilder
from heron.worker.spec_verify import verify_drafts
from heron.worker.step_inputs import PendingInputIds, StepInputs, build_step_inputs, on_device

if TYPE_CHECKING:  # CUDA only: imported where graphs are captured
    from heron.worker.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class StructuredStep:
    """The grammar bitmask of this step's structured requests (in
    ``request_ids`` order, one row per logits row of each: 1 + its drafts) and
    how to apply it to logits rows."""

    request_ids: list[str]
    bitmask: Any
    apply: Callable[[torch.Tensor, Any, list[int]], None]


@dataclass
class _SampledTokens:
    """Per request of the step: the tokens it emitted ([] if none) and their
    logprobs (None where not asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]

    @staticmethod
    def none(num_reqs: int) -> _SampledTokens:
        return _SampledTokens([[] for _ in range(num_reqs)], [None] * num_reqs)


@dataclass
class _PlainSample:
    """The sampler's output for the step rows ``rows`` (requests ``states``)."""

    rows: list[int]
    states: list[CachedRequestState]
    output: SamplerOutput

    def record_into(self, sampled: _SampledTokens) -> None:
        entries = _split_logprobs(self.output, self.states)
        for row, token_id, entry in zip(self.rows, self.output.sampled_token_ids.tolist(), entries):
            sampled.token_ids[row] = [token_id]
            sampled.logprobs[row] = None if entry is None else [entry]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.cache.block_size
        self._applied_transfers: KVTransfers | None = None  # the last step's tier copies, once made
        started = time.perf_counter()
        self.model = build_model(config.model, self.device, config.kv_cache_dtype)
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
            config.scheduler.max_num_seqs, cdiv(config.model.max_model_len, config.cache.block_size)
        )
        self.kv_caches: list[torch.Tensor] = []
        self.all_kv_caches: list[torch.Tensor] = []  # the draft model's too
        self.offload_store: HostKVStore | None = None
        self.disk_store: DiskKVStore | None = None
        self.kv_load_reports = LoadReports()  # disk and remote loads report here
        self.kv_server: KVBlockServer | None = None  # prefill side of P/D disaggregation
        self.kv_loader: RemoteKVLoader | None = None  # decode side
        self.decode_graphs: DecodeGraphRunner | None = None  # CUDA only
        # the last deferred step's sampled ids (on the device) and each request's row
        self._last_sampled: torch.Tensor | None = None
        self._last_sampled_rows: dict[str, int] = {}
        if config.compile_model:
            self.model.forward = torch.compile(self.model.forward, dynamic=True)  # type: ignore[method-assign]

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and self.backend.name == "triton" and not self.config.enforce_eager

    # ---- KV cache --------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block in every layer's cache (and the draft model's)."""
        target = layers_bytes_per_block(self.attention_layers, self.block_size, self.config.kv_cache_dtype)
        return target + (self.proposer.kv_cache_bytes_per_block() if self.proposer is not None else 0)

    def initialize_kv_cache(self, num_blocks: int, num_offload_blocks: int = 0) -> None:
        """Allocate every layer's cache, zeroed (stale NaNs in padded slots would
        leak through a masked softmax as 0 * NaN), and bind it to its layer. With
        CUDA graphs, one extra block past the pool is the padded rows' scratch.
        ``num_offload_blocks``: the size of a host-memory offload tier (0: none)."""
        num_allocated = num_blocks + (1 if self.use_cuda_graphs else 0)
        self._bind_kv_caches(num_allocated)
        draft_caches: list[torch.Tensor] = []
        if self.proposer is not None:
            draft_caches = self.proposer.bind_kv_caches(num_allocated)
        self.all_kv_caches = self.kv_caches + draft_caches
        if num_offload_blocks:
            self.offload_store = HostKVStore(self.all_kv_caches, num_offload_blocks)
        if self.use_cuda_graphs:
            from heron.attention.triton_backend import TritonAttentionBackend
            from heron.worker.cuda_graphs import DecodeGraphRunner

            assert isinstance(self.backend, TritonAttentionBackend)  # use_cuda_graphs checks its name
            self.decode_graphs = DecodeGraphRunner(
                self.model,
                self.backend,
                max_num_seqs=self.config.scheduler.max_num_seqs,
                max_blocks_per_seq=cdiv(self.config.model.max_model_len, self.block_size),
                block_size=self.block_size,
                scratch_slot=num_blocks * self.block_size,
                device=self.device,
            )
            reason = self.decode_graphs.capture()
            if reason is not None:
                logger.warning("CUDA graphs are off: the model's decode step cannot be captured (%s); "
                               "decode steps run eagerly", reason)
                self.decode_graphs = None
                self.compute_path["decode"] = "eager (the forward cannot be captured)"

    def kv_cache_layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Each layer's cache dtype and per-block shape (what a block's bytes mean)."""
        return [(str(cache.dtype), tuple(cache[:, 0].shape)) for cache in self.all_kv_caches]

    def attach_disk_tier(self, layout: DiskTierLayout) -> None:
        """Read and write the disk KV tier's block files (after ``initialize_kv_cache``)."""
        self.disk_store = DiskKVStore(layout, self.all_kv_caches, self.kv_load_reports)

    def attach_kv_transfer(self, config: KVTransferConfig, fingerprint: bytes) -> str | None:
        """Serve finished prefills' blocks and/or pull them (after ``initialize_kv_cache``);
        returns the address decode engines pull from (None: a pure consumer)."""
        if config.consumes:
            self.kv_loader = RemoteKVLoader(self.all_kv_caches, fingerprint, self.kv_load_reports,
                                            config.kv_timeout_seconds)
        if not config.produces:
            return None
        self.kv_server = KVBlockServer(self.all_kv_caches, fingerprint, config.kv_ip, config.kv_port)
        host = socket.gethostname() if config.kv_ip in ("0.0.0.0", "*") else config.kv_ip
        return f"tcp://{host}:{self.kv_server.port}"

    def start_remote_loads(self, loads: list[RemoteLoad]) -> None:
        if loads:
            assert self.kv_loader is not None
            self.kv_loader.load(loads)

    def offer_kv(self, offers: list[tuple[str, list[int], list[bytes]]]) -> None:
        assert self.kv_server is not None or not offers
        for request_id, block_ids, block_hashes in offers:
            assert self.kv_server is not None
            self.kv_server.offer(request_id, block_ids, block_hashes)

    def withdraw_kv(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            assert self.kv_server is not None
            self.kv_server.withdraw(request_id)

    def take_released_kv(self) -> list[str]:
        return self.kv_server.take_released() if self.kv_server is not None else []

    def wait_for_kv_release(self, timeout: float) -> None:
        if self.kv_server is not None:
            self.kv_server.wait_for_release(timeout)

    def take_failed_disk_writes(self) -> list[BlockHash]:
        return self.disk_store.take_failed_writes() if self.disk_store is not None else []

    def take_finished_kv_loads(self) -> tuple[list[tuple[str, list[BlockHash]]], dict[str, str], set[str]]:
        """Background KV loads done since the last call: (request id, hashes that failed), why
        the failed ones did, by request id, and the ids of those that only missed (``LoadReports``)."""
        return self.kv_load_reports.take_with_errors()

    def wait_for_kv_loads(self, timeout: float) -> None:
        self.kv_load_reports.wait(timeout)

    def apply_kv_transfers(self, transfers: KVTransfers, room_first: bool = True) -> None:
        """The tier copies a step makes before its forward pass (or, with no step
        coming, the disk tier's last writes): disk captures, then the host tier's
        saves and loads, then the disk loads start (they run on in the background).
        Every copy out of the pool is queued before any disk load can overwrite a
        block: a block evicted to the host tier and refilled from disk in one step
        used to reach the host tier with the disk's contents, under its old hash.

        All of them or none: the tiers' indexes list these blocks from the moment
        the step was scheduled, so a Ctrl-C is held until the copies are made (one
        half way left a host slot listed with stale bytes, and a disk load never
        started held its request and pool blocks for ever). Only copies, never a
        wait, are held: the wait for room in the disk tier's buffer comes first
        (``room_first``), where a Ctrl-C stops it (a stuck disk held it for ever)."""
        if transfers.disk and room_first:
            assert self.disk_store is not None
            self.disk_store.wait_for_room()
        with interrupts_deferred():
            if transfers.disk:
                assert self.disk_store is not None
                self.disk_store.capture(transfers.disk, wait=False)
            if transfers.saves or transfers.loads:
                assert self.offload_store is not None
                self.offload_store.apply(transfers)
            if transfers.disk:
                assert self.disk_store is not None
                self.disk_store.start_loads(transfers.disk)
            self._applied_transfers = transfers

    def finish_kv_transfers(self, transfers: KVTransfers | None) -> None:
        """Make the copies of a step that raised before it made them (an
        interrupt while it was being prepared): the tiers already list them."""
        if transfers and transfers is not self._applied_transfers:
            self.apply_kv_transfers(transfers, room_first=False)

    def close(self) -> None:
        """Finish the disk tier's queued writes; stop serving and pulling blocks."""
        if self.disk_store is not None:
            self.disk_store.close()
        if self.kv_server is not None:
            self.kv_server.close()
        if self.kv_loader is not None:
            self.kv_loader.close()

    def _bind_kv_caches(self, num_blocks: int) -> None:
        self.kv_caches = bind_kv_caches(
            self.attention_layers, self.backend, num_blocks, self.block_size, self.config.kv_cache_dtype, self.device
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
        blocks_needed = sum(cdiv(length, self.block_size) for length in lengths)
        self._bind_kv_caches(blocks_needed)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        block_table = np.zeros((len(lengths), max(cdiv(n, self.block_size) for n in lengths)), dtype=np.int32)
        cursor = 0
        for row, length in enumerate(lengths):
            count = cdiv(length, self.block_size)
            block_table[row, :count] = np.arange(cursor, cursor + count)
            cursor += count
        counts = np.array(lengths, dtype=np.int64)
        layout, positions = flat_batch_layout(np.zeros_like(counts), counts, block_table, self.block_size, self.device)
        hidden = self.model(
            torch.zeros(layout.num_tokens, dtype=torch.int64, device=self.device),
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
        for request_id in scheduler_output.forgotten_req_ids:
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
        if scheduler_output.kv_transfers:
            with phase("kv_offload"):
                self.apply_kv_transfers(scheduler_output.kv_transfers)
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
                output_rows=self._output_rows(step),
            )
        with phase("sample"):
            return self._sample(step, hidden, None, structured, defer_output)

    def _output_rows(self, step: StepInputs) -> torch.Tensor | None:
        """The rows of the step's hidden states that sampling reads, where those are
        fewer than all and no request scores its prompt (prompt logprobs read every
        prompt row): the model may skip its last layer's work for the rest (a
        prompt's rows but its last, every row of a chunk short of the prompt's end).
        None on a device other than the CPU (the index would be a host copy)."""
        num_tokens = len(step.input_ids)
        if self.device.type != "cpu" or (len(step.sample_rows) == num_tokens and not any(step.drafts)):
            return None  # a batch of plain decodes reads every row
        if any(state.sampling_params.prompt_logprobs is not None for state in step.states):
            return None
        index, _ = step.logits_rows
        if len(index) == num_tokens or (len(index) > 1 and bool(np.any(np.diff(index) <= 0))):
            return None
        return torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))

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
        graphs = self.decode_graphs
        return build_step_inputs(
            scheduler_output,
            self.requests,
            self.block_rows,
            block_size=self.block_size,
            device=self.device,
            last_sampled_rows=self._last_sampled_rows,
            graph_fits=None if graphs is None else (lambda num_reqs: graphs.bucket_for(num_reqs) is not None),
        )

    def _sample(
        self,
        step: StepInputs,
        hidden: torch.Tensor | None,
        decode_logits: torch.Tensor | None,
        structured: StructuredStep | None = None,
        defer_output: bool = False,
    ) -> ModelRunnerOutput | PendingRunnerOutput:
        """Sample the rows that reached their last token, in order: select their
        logits rows -> apply grammar masks -> sample (plain rows) or verify drafts
        (speculative rows) -> advance the states. Either ``hidden`` (all tokens)
        or ``decode_logits`` (one row per request, from a CUDA graph) is given."""
        prompt_logprobs = self._prompt_logprobs(step, hidden) if hidden is not None else {}
        sampled = _SampledTokens.none(len(step.states))
        plain: _PlainSample | None = None
        if step.sample_rows:
            logits, offsets = self._select_logits(step, hidden, decode_logits)
            if structured is not None:
                self._apply_grammar(step, structured, logits, offsets)
            plain = self._sample_plain_rows(step, logits, offsets)
            if plain is not None and not defer_output:
                plain.record_into(sampled)
            self._verify_draft_rows(step, logits, offsets, sampled)
        self._advance_states(step, sampled.token_ids)
        if defer_output and plain is not None:
            assert not any(step.drafts), "async scheduling does not verify drafts"
            return self._defer_output(step, plain, prompt_logprobs)
        draft_token_ids = {}
        if self.proposer is not None:
            with phase("propose"):
                draft_token_ids = self.proposer.propose(step.states, [bool(ids) for ids in sampled.token_ids])
        return ModelRunnerOutput(
            req_ids=step.request_ids,
            sampled_token_ids=sampled.token_ids,
            logprobs=sampled.logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=draft_token_ids,
        )

    def _select_logits(
        self, step: StepInputs, hidden: torch.Tensor | None, decode_logits: torch.Tensor | None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The logits rows to sample (each sample row's last token, preceded by one
        per draft it verifies) and each sample row's offset into them."""
        if decode_logits is not None:  # one token per request: no drafts
            offsets = np.arange(len(step.sample_rows) + 1, dtype=np.int64)
            if len(step.sample_rows) == len(step.states):
                return decode_logits, offsets
            return decode_logits[on_device(step.sample_rows, torch.int64, self.device)], offsets
        assert hidden is not None
        index, offsets = step.logits_rows
        return self.model.compute_logits(hidden.index_select(0, on_device(index, torch.int64, self.device))), offsets

    @staticmethod
    def _apply_grammar(step: StepInputs, structured: StructuredStep, logits: torch.Tensor, offsets: np.ndarray) -> None:
        position = {step.request_ids[row]: i for i, row in enumerate(step.sample_rows)}
        members = [position[request_id] for request_id in structured.request_ids]
        structured.apply(logits, structured.bitmask, _logits_rows_of(offsets, members).tolist())

    def _sample_plain_rows(self, step: StepInputs, logits: torch.Tensor, offsets: np.ndarray) -> _PlainSample | None:
        """Sample the rows without drafts in one batched call (None: there are none)."""
        plain = [i for i, row in enumerate(step.sample_rows) if not step.drafts[row]]
        if not plain:
            return None
        if len(plain) < len(step.sample_rows):  # some rows verify drafts: keep the others' rows
            logits = logits[on_device(offsets[plain], torch.int64, self.device)]
        rows = [step.sample_rows[i] for i in plain]
        states = [step.states[row] for row in rows]
        return _PlainSample(rows, states, self.sampler(logits, self.sampling_metadata.build(states)))

    def _verify_draft_rows(
        self, step: StepInputs, logits: torch.Tensor, offsets: np.ndarray, sampled: _SampledTokens
    ) -> None:
        """Verify the drafts of the rows that have them (rejection sampling)."""
        spec = [i for i, row in enumerate(step.sample_rows) if step.drafts[row]]
        if not spec:
            return
        spec_rows = [step.sample_rows[i] for i in spec]
        tokens, spec_logprobs = verify_drafts(
            self.rejection_sampler,
            logits[on_device(_logits_rows_of(offsets, spec), torch.int64, self.device)],
            [step.states[row] for row in spec_rows],
            [step.drafts[row] for row in spec_rows],
            self.vocab_size,
            self.device,
        )
        for row, emitted, entry in zip(spec_rows, tokens, spec_logprobs):
            sampled.token_ids[row] = emitted
            sampled.logprobs[row] = entry

    @staticmethod
    def _advance_states(step: StepInputs, sampled_token_ids: list[list[int]]) -> None:
        """Append each row's emitted tokens and count its computed tokens:
        rejected drafts' K/V will be overwritten, so they do not count."""
        for row, state in enumerate(step.states):
            emitted = sampled_token_ids[row]
            state.token_ids.extend(emitted)
            num_rejected = len(step.drafts[row]) + 1 - len(emitted) if step.drafts[row] else 0
            state.num_computed_tokens += int(step.num_scheduled[row]) - num_rejected

    def _defer_output(
        self, step: StepInputs, plain: _PlainSample, prompt_logprobs: dict[str, list[TokenLogprobs]]
    ) -> PendingRunnerOutput:
        """Start copying this step's samples to the host and return at once; the
        states count the tokens as pending until ``get()`` appends them."""
        for state in plain.states:
            state.num_pending_tokens += 1
        self._last_sampled = plain.output.sampled_token_ids
        self._last_sampled_rows = {state.request_id: i for i, state in enumerate(plain.states)}
        output = plain.output
        host = _PlainSample(plain.rows, plain.states, SamplerOutput(
            _to_host(output.sampled_token_ids),
            _to_host(output.logprob_token_ids),
            _to_host(output.logprobs),
            _to_host(output.sampled_ranks),
        ))
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        if copied is not None:
            copied.record()

        def resolve() -> ModelRunnerOutput:
            if copied is not None:
                copied.synchronize()  # this step's copy only, not the steps queued since
            sampled = _SampledTokens.none(len(step.states))
            host.record_into(sampled)
            for state, token_ids in zip(host.states, (sampled.token_ids[row] for row in host.rows)):
                state.token_ids.extend(token_ids)
                state.num_pending_tokens -= 1
            return ModelRunnerOutput(step.request_ids, sampled.token_ids, sampled.logprobs, prompt_logprobs)

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
            result[state.request_id] = gathered.token_logprobs()  # num_top columns already
        return result


@overload
def _to_host(tensor: torch.Tensor) -> torch.Tensor: ...
@overload
def _to_host(tensor: None) -> None: ...
def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Start a copy to (pinned) host memory, in stream order: no wait."""
    return None if tensor is None else tensor.to("cpu", non_blocking=True)


def _logits_rows_of(offsets: np.ndarray, members: list[int]) -> np.ndarray:
    """The logits rows of the given sample rows (``offsets`` from
    ``StepInputs.logits_rows``), in order."""
    return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])


def _split_logprobs(output: SamplerOutput, states: list[CachedRequestState]) -> list[TokenLogprobs | None]:
    """Each sampled row's logprobs, trimmed to what its request asked for (None: nothing)."""
    if output.logprob_token_ids is None:
        return [None] * len(states)
    rows = output.token_logprobs()
    return [None if (n := s.sampling_params.logprobs) is None else row.top(n) for s, row in zip(states, rows)]
