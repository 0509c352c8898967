"""``AsyncLLM``: the async streaming API, with the engine core in its own process.

Tokenization, detokenization and everything asyncio happen here, in the caller's
process, while the engine-core process runs forward passes, so the two overlap.
Each request gets a ``RequestOutputCollector``: when the consumer reads slower
than tokens arrive, streamed deltas are merged into one pending output instead
of queueing, so a slow reader holds at most its own (max_tokens-bounded) output.

    llm = AsyncLLM(EngineArgs().create_engine_config())
    await llm.wait_until_ready()
    async for output in llm.generate(prompt, params, "request-1"):
        print(output.outputs[0].text, end="")
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from heron.config import EngineConfig
from heron.engine.core_client import EngineCoreClient, EngineCoreEndpoint, OwnedEngineCore
from heron.engine.dp_client import DataParallelClient, start_engine_cores
from heron.engine.input_processor import InputProcessor, InvalidRequestError, ProcessedPrompt
from heron.engine.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from heron.engine.output_processor import OutputProcessor
from heron.engine.serialization import MessageKind, decode_outputs
from heron.loader.tokenizer import load_tokenizer
from heron.metrics.logging_stats import LoggingStatLogger
from heron.metrics.prometheus import PrometheusStatLogger
from heron.metrics.stats import IterationStats
from heron.outputs import RequestOutput
from heron.sampling_params import RequestOutputKind, SamplingParams
from heron.step_outputs import EngineCoreOutputs, SchedulerStats

WATCH_INTERVAL_S = 0.5  # how often the engine watch looks at the engine core(s)
# how long an engine core found gone before it was ready has for its last message (why it failed) to be read:
# sent before it exited, it lost the race to the exit code now and then
LAST_WORD_GRACE_S = 1.0

logger = logging.getLogger(__name__)

StartedEngineCore = OwnedEngineCore | EngineCoreEndpoint


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class ServerStoppingError(RuntimeError):
    """The server's graceful stop ran out of time before this request finished."""


class EngineNotReadyError(RuntimeError):
    """The engine core is still loading the model."""


class EngineRequestError(RuntimeError):
    """The engine could not serve one request (finish reason "error": its KV
    blocks could not be loaded under ``kv_load_failure_policy`` "fail"); the
    engine itself serves on."""


class RequestOutputCollector:
    """Hands outputs from the output loop to one request's consumer. DELTA outputs
    that pile up are merged, so memory per request stays bounded."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if pending is None or isinstance(item, BaseException) or isinstance(pending, BaseException):
            self._pending = item
        elif self.kind == RequestOutputKind.DELTA:
            _merge_delta(pending, item)
        else:
            self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item = self._pending
        self._pending = None
        self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for completion in new.outputs:
        existing = by_index.get(completion.index)
        if existing is None:
            into.outputs.append(completion)
            by_index[completion.index] = completion
            continue
        existing.text += completion.text
        existing.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            existing.logprobs = (existing.logprobs or []) + completion.logprobs
        existing.cumulative_logprob = completion.cumulative_logprob
        existing.finish_reason = completion.finish_reason
        existing.stop_reason = completion.stop_reason
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log_level: str = "INFO",
        log_stats_interval_s: float = 10.0,
        started: StartedEngineCore | Sequence[StartedEngineCore] | None = None,
        record_engine_stats: bool = True,
        stats_scope: str = "",
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        step_timeout_s: float = 0.0,
        load_tokenizer_in_background: bool = False,
    ) -> None:
        """``started``: the engine core(s) already started on ``config``'s
        arguments (one per data-parallel rank): processes this object owns, or
        endpoints of processes another one owns (``--api-server-count``).
        ``record_engine_stats``: put the engines' statistics in this process's
        metrics (one API server of several does). ``stats_scope``: what the
        periodic log line's throughput covers, when not the whole server.
        ``heartbeat_timeout_s`` / ``step_timeout_s``: an engine core silent that
        long, or one step running that long, counts as dead (0: never; ``liveness.py``).
        ``load_tokenizer_in_background``: load the tokenizer on a thread once
        ``start()`` runs, so that a server answers (503 "loading") while it loads;
        until it has, ``tokenizer`` and the processors are not set and
        ``is_ready`` is False. A load that fails is ``tokenizer_error``, raised by
        ``wait_until_ready``."""
        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.step_timeout_s = step_timeout_s
        # start the engine cores first: they load the model while we load the tokenizer
        self.client: EngineCoreClient | DataParallelClient
        if config.data_parallel_size > 1:
            processes = list(started) if isinstance(started, Sequence) else start_engine_cores(config, log_level)
            self.client = DataParallelClient(config, processes)
        else:
            single = started[0] if isinstance(started, Sequence) else started
            self.client = EngineCoreClient(config, log_level, single)
        self.tokenizer: Any
        self.input_processor: InputProcessor
        self.output_processor: OutputProcessor
        self.tokenizer_loaded = False
        self.tokenizer_error: Exception | None = None
        self._tokenizer_loading: asyncio.Task[None] | None = None
        if not load_tokenizer_in_background:
            self._load_tokenizer()
        self.metrics = PrometheusStatLogger(config.model.served_model_name, record_engine_stats=record_engine_stats)
        self.stat_logger = LoggingStatLogger(log_stats_interval_s, stats_scope)
        self._collectors: dict[str, RequestOutputCollector] = {}
        # requests sent to the engine that have produced no token yet
        self._not_started: set[str] = set()
        # told the number of waiting requests whenever it changes (shared gateway state)
        self.on_waiting_changed: Callable[[int], None] | None = None
        self.last_scheduler_stats = SchedulerStats()
        self.engine_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        # why the engine core could not load the model (its files, the arguments): the user's to fix
        self.load_error: str | None = None
        self._ready: asyncio.Event | None = None  # set once the engine core and the tokenizer are both ready
        self._engine_core_ready = False
        # done with dead_reason (made in start(), in the serving loop); every send races it
        self._dead: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Future[Any]] = set()  # fire-and-forget utility calls, held till done
        self._hung = False  # marked dead while its process still existed (liveness.py)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> asyncio.Event:
        """Start the output loop and the engine watch (once; inside the event
        loop that serves requests). The event is set when the engine is ready."""
        if self._ready is None:
            self._ready = asyncio.Event()
            self._dead = asyncio.get_running_loop().create_future()
            if self.dead_reason is not None:
                self._dead.set_result(None)
            self._tasks = [
                asyncio.create_task(self._output_loop(), name="heron-output-loop"),
                asyncio.create_task(self._watch_engine(), name="heron-engine-watch"),
            ]
            if not self.tokenizer_loaded:
                self._tokenizer_loading = asyncio.create_task(self._load_tokenizer_off_loop(), name="heron-tokenizer")
                self._tasks.append(self._tokenizer_loading)
        return self._ready

    def _load_tokenizer(self) -> None:
        tokenizer = load_tokenizer(self.config.model)
        self.input_processor = InputProcessor(self.config.model, tokenizer, self.config.scheduler.policy == "priority")
        self.output_processor = OutputProcessor(tokenizer)
        self.tokenizer = tokenizer
        self.tokenizer_loaded = True

    async def _load_tokenizer_off_loop(self) -> None:
        """The tokenizer, on a thread (seconds for a large one, with transformers' imports)."""
        try:
            await asyncio.to_thread(self._load_tokenizer)
        except Exception as exc:
            self.tokenizer_error = exc
        self._set_ready_if_whole()

    async def wait_for_tokenizer(self) -> None:
        """Until the tokenizer has loaded, or failed to (``tokenizer_error``)."""
        if self._tokenizer_loading is not None:
            await asyncio.shield(self._tokenizer_loading)

    def _set_ready_if_whole(self) -> None:
        """Ready once the engine core and the tokenizer are (or, to wake its waiters, once loading failed)."""
        assert self._ready is not None
        if self.tokenizer_error is not None or (self._engine_core_ready and self.tokenizer_loaded):
            self._ready.set()

    @property
    def is_ready(self) -> bool:
        return (self._ready is not None and self._ready.is_set() and self.dead_reason is None
                and self.tokenizer_error is None)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        ready = self.start()
        waiter = asyncio.create_task(ready.wait())
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not ready.is_set():
                if self.dead_reason is not None:
                    raise EngineDeadError(self.dead_reason)
                if self.tokenizer_error is not None:
                    raise self.tokenizer_error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("the engine core did not become ready in time")
                await asyncio.wait({waiter}, timeout=min(0.2, remaining) if remaining is not None else 0.2)
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if self.tokenizer_error is not None:
                raise self.tokenizer_error
        finally:
            waiter.cancel()

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        # a hung engine core will not stop when asked: stop (then kill) it at once
        self.client.shutdown(timeout=1.0 if self._hung else 5.0)

    # ---- requests ------------------------------------------------------------------

    @property
    def num_waiting_requests(self) -> int:
        """Requests accepted that have not produced a token yet (queued or prefilling)."""
        return len(self._not_started)

    def generate(
        self,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate the request now (raising before anything is streamed), then
        return the stream of its outputs (per ``params.output_kind``) until it
        finishes. Cancelling the consumer (e.g. a client disconnect) aborts it."""
        self.start()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.is_ready:
            raise EngineNotReadyError("the model is still loading")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        core_requests = self.input_processor.make_requests(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        try:
            engine_ids = self.output_processor.add_request(request_id, prompt, params, arrival_time)
        except Exception:
            self.output_processor.abort_request(request_id)  # the samples registered before the failure
            raise
        collector = RequestOutputCollector(params.output_kind)
        self._collectors[request_id] = collector
        self._not_started.update(engine_ids)
        self._waiting_changed()
        return self._stream(request_id, collector, core_requests, engine_ids)

    def release_refused_prefill(self, handle: dict[str, Any] | None) -> None:
        """A request refused before it reached the engine core that names a
        prefill engine's handle frees that engine's lease now (its blocks stayed
        held for the lease's 30 s: a burst of refusals filled the prefill
        engine's pool). A handle already pulled or released is ignored there."""
        if not isinstance(handle, dict) or not handle.get("do_remote_prefill") or not self.is_ready:
            return
        task = asyncio.ensure_future(self.call_utility("release_remote_prefill", dict(handle)))
        self._background.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("could not release a refused request's prefill lease: %s", task.exception())

    async def _stream(
        self,
        request_id: str,
        collector: RequestOutputCollector,
        core_requests: list[Any],
        engine_ids: list[str],
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            for core_request in core_requests:
                await self._send_unless_dead(self.client.add_request(core_request))
            if isinstance(self.client, DataParallelClient):
                self.refresh_engine_metrics()  # at once: other API servers' scrapes read it too
            while True:
                output = await collector.get()
                finished = output.finished
                failed = next((sample for sample in output.outputs if sample.finish_reason == "error"), None)
                if failed is not None:
                    raise EngineRequestError(failed.error or "the engine failed the request")
                error = next((sample.error for sample in output.outputs if sample.error), None)
                if error is not None:  # the engine could not run it as asked (a constraint it could not compile)
                    raise InvalidRequestError(error, "structured_outputs")
                yield output
                if finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            self._not_started.difference_update(engine_ids)
            self._waiting_changed()
            if not finished:
                self.abort_nowait(request_id)  # no await: we may be inside a cancellation

    async def _send_unless_dead(self, send: Coroutine[Any, Any, None]) -> None:
        """Await a send to the engine core(s), or raise EngineDeadError when they
        die first: a send to a peer that is gone waits for ever."""
        assert self._dead is not None  # start() ran
        task = asyncio.ensure_future(send)
        sent = False
        try:
            await asyncio.wait((task, self._dead), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sent = task.done()
            if not sent:
                task.cancel()  # given up on (dead engine), or our caller was cancelled
        if not sent:
            raise EngineDeadError(self.dead_reason or "the engine core is gone")
        task.result()

    def discard(self, request_id: str) -> None:
        """Forget a request whose stream was never iterated (nothing was sent to
        the engine core yet)."""
        self._collectors.pop(request_id, None)
        self._not_started.difference_update(self._forget(request_id))
        self._waiting_changed()

    def _waiting_changed(self) -> None:
        if self.on_waiting_changed is not None:
            self.on_waiting_changed(len(self._not_started))

    def abort_nowait(self, request_id: str) -> None:
        """Forget a request here at once and tell the engine core to free it."""
        engine_ids = self._forget(request_id)
        if engine_ids and self.dead_reason is None:
            asyncio.get_running_loop().create_task(self.client.abort_requests(engine_ids))

    async def abort(self, request_id: str) -> None:
        engine_ids = self._forget(request_id)
        if engine_ids and self.dead_reason is None:
            await self.client.abort_requests(engine_ids)

    def _forget(self, request_id: str) -> list[str]:
        stats = IterationStats()
        engine_ids = self.output_processor.abort_request(request_id, stats)
        self._record_stats(None, stats)
        return engine_ids

    async def reset_prefix_cache(self) -> bool:
        """Forget every engine core's cached prefixes (``EngineCore.reset_prefix_cache``);
        False when any refused, requests holding blocks there. Every engine core is
        asked first whether it is idle: one reset beside a busy one (the answer then a
        409) had forgotten its prefixes, and deleted the files of the disk tier they
        share, for nothing (found by the fleet review)."""
        if not await self.call_utility("prefix_cache_idle"):
            return False
        return bool(await self.call_utility("reset_prefix_cache"))

    async def call_utility(self, method: str, *args: Any) -> Any:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        return await self.client.call_utility(method, *args)

    # ---- background tasks ----------------------------------------------------------

    async def _output_loop(self) -> None:
        """The engine core's messages, until it fails. A message this loop cannot
        handle (a bug, a version skew) marks the engine dead: a loop that ended in
        silence left every request waiting while /health said ok."""
        try:
            await self._read_outputs()
        except Exception as exc:
            logger.exception("reading the engine core's outputs failed")
            self._mark_dead(f"the engine core's outputs could not be read: {exc!r}")

    async def _read_outputs(self) -> None:
        assert self._ready is not None
        while True:
            kind, payload = await self.client.receive()
            if kind == MessageKind.OUTPUTS:
                self._handle_outputs(payload)
            elif kind == MessageKind.READY:
                mismatch = _resolution_mismatch(self.config, payload.get("resolved") or {})
                if mismatch:
                    self._mark_dead(f"the engine core resolved the arguments differently: {mismatch}")
                    return
                self.engine_info = payload
                self.metrics.set_compute_path(payload.get("compute_path") or {})
                self._engine_core_ready = True
                self._set_ready_if_whole()
                logger.info(
                    "engine core ready (pid %s, %s KV blocks)", payload.get("pid"), payload.get("num_kv_blocks")
                )
            elif kind == MessageKind.FAILED:
                self._mark_dead(f"the engine core failed: {payload}")
                return
            elif kind == MessageKind.LOAD_FAILED:
                self.load_error = str(payload)
                self._mark_dead(f"the engine core could not load the model: {payload}")
                return

    def _handle_outputs(self, payload: Any) -> None:
        # data-parallel outputs arrive decoded (their statistics merged)
        core_outputs = payload if isinstance(payload, EngineCoreOutputs) else decode_outputs(payload)
        if not self.tokenizer_loaded:  # statistics only: no request is accepted before the tokenizer is there
            self._record_stats(core_outputs.scheduler_stats, IterationStats())
            return
        processed = self.output_processor.process_outputs(core_outputs.outputs, core_outputs.timestamp or None)
        waiting = len(self._not_started)
        for output in core_outputs.outputs:
            if output.new_token_ids or output.finished:
                self._not_started.discard(output.request_id)
        if len(self._not_started) != waiting:
            self._waiting_changed()
        for request_output in processed.request_outputs:
            collector = self._collectors.get(request_output.request_id)
            if collector is not None:
                collector.put(request_output)
        if processed.request_ids_to_abort:
            asyncio.get_running_loop().create_task(self.client.abort_requests(processed.request_ids_to_abort))
        self._record_stats(core_outputs.scheduler_stats, processed.iteration_stats)

    def refresh_engine_metrics(self) -> None:
        """Per-engine figures read at scrape time (data parallelism)."""
        if isinstance(self.client, DataParallelClient):
            self.metrics.set_engine_requests(self.client.requests_per_engine())

    def _record_stats(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
        self.metrics.record(scheduler_stats, iteration)
        self.stat_logger.record(scheduler_stats, iteration)

    async def _watch_engine(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self.client.is_alive():
                if not self._engine_core_ready:  # its last word (why it could not start) may still wait unread
                    await asyncio.sleep(LAST_WORD_GRACE_S)
                    if self.load_error is None and self.client.could_not_load():  # the word was lost
                        self.load_error = "the engine core could not load the model (its log says why)"
                self._mark_dead(self.client.exit_reason())
                return
            previous, tick = tick, time.monotonic()
            # after this loop itself was held (a long call in a handler), the engine's messages wait unread
            # in the socket: judge its silence only once they have had a turn to be read
            if tick - previous < WATCH_INTERVAL_S + HEARTBEAT_INTERVAL_S:
                hung = self.client.hung_reason(self.heartbeat_timeout_s, self.step_timeout_s)
                if hung is not None:
                    self._hung = True
                    self._mark_dead(hung)
                    return
            self.stat_logger.maybe_log()

    def fail_in_flight(self, reason: str) -> int:
        """End every request still running with ServerStoppingError: its consumer
        answers with an error (503, or an error event) and aborts it. How many."""
        error = ServerStoppingError(reason)
        for collector in self._collectors.values():
            collector.put(error)
        return len(self._collectors)

    def engine_gone(self, reason: str) -> None:
        """Told from outside (``--api-server-count``'s launcher) that an engine core has ended
        (before it was ready, after its last word has had time to be read)."""
        if self._engine_core_ready:
            self._mark_dead(reason)
        else:
            asyncio.get_running_loop().call_later(LAST_WORD_GRACE_S, self._mark_dead, reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if self._dead is not None and not self._dead.done():
            self._dead.set_result(None)
        logger.error("%s", reason)
        self.metrics.engine_gone()
        error = EngineDeadError(reason)
        for collector in self._collectors.values():
            collector.put(error)
        self.client.fail_pending_calls(error)
        if self._ready is not None:
            self._ready.set()  # wake anyone waiting for readiness: they will see it dead


def _resolution_mismatch(config: EngineConfig, resolved: dict[str, Any]) -> str:
    """Where the engine core's resolved config differs from ``config`` ("" if nowhere)."""
    ours = config.resolved_summary()
    return ", ".join(f"{key} {ours[key]!r} here, {resolved[key]!r} there" for key in ours
                     if key in resolved and resolved[key] != ours[key])
