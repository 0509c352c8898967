"""The engine core: scheduler + model runner, one ``step()`` at a time.

It never touches text: requests arrive tokenized (``EngineCoreRequest``) and leave
as token deltas (``EngineCoreOutput``). The same class runs in-process for the
offline ``LLM`` and inside the engine-core process behind the API server.

With async scheduling (the default on CUDA), ``step()`` schedules and launches
step N+1 before it waits for step N's sampled tokens: the host's scheduling,
input preparation and output handling overlap the device's work, and the device
reads step N's tokens as step N+1's inputs without a round trip. While any
unfinished request needs its previous token on the host to sample the next one
(penalties, grammars), steps run one at a time.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from heron.config import EngineConfig
from heron.core.kv_disk_layout import DiskTierLayout, layout_fingerprint
from heron.core.kv_remote import RemoteLoad
from heron.core.scheduler import Scheduler
from heron.core.scheduler_output import SchedulerOutput
from heron.engine.kv_events_publisher import ZmqEventPublisher
from heron.profiling import StepProfiler, phase
from heron.request import EngineCoreRequest, Request, RequestStatus
from heron.step_outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, PendingRunnerOutput
from heron.worker.kv_cache_sizing import determine_num_kv_blocks, gpu_kv_cache_budget
from heron.worker.model_runner import ModelRunner, StructuredStep

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._shut_down = False
        self.model_runner = ModelRunner(config)
        cache = config.cache
        gpu_budget = None
        if config.device.type == "cuda" and cache.num_kv_blocks is None and cache.kv_cache_memory_bytes is None:
            scheduler = config.scheduler
            gpu_budget = gpu_kv_cache_budget(
                cache.gpu_memory_utilization,
                lambda: self.model_runner.profile_peak_memory(scheduler.max_num_batched_tokens, scheduler.max_num_seqs),
                config.device,
            )
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block()
        num_blocks = determine_num_kv_blocks(
            cache,
            bytes_per_block,
            config.device,
            config.model.max_model_len,
            config.scheduler.max_num_seqs,
            gpu_budget,
        )
        num_offload_blocks = cache.kv_offloading_bytes // bytes_per_block
        if cache.kv_offloading_bytes and num_offload_blocks < 1:
            raise ValueError(f"kv_offloading_size {cache.kv_offloading_bytes} bytes holds no block of "
                             f"{bytes_per_block} bytes")
        self.model_runner.initialize_kv_cache(num_blocks, num_offload_blocks)
        fingerprint = self._layout_fingerprint() if cache.kv_offloading_dir or config.kv_transfer else b""
        disk_layout = self._disk_tier_layout(fingerprint, bytes_per_block) if cache.kv_offloading_dir else None
        if disk_layout is not None:
            self.model_runner.attach_disk_tier(disk_layout)
        kv_transfer_address = (self.model_runner.attach_kv_transfer(config.kv_transfer, fingerprint)
                               if config.kv_transfer else None)
        from heron.structured_output.manager import StructuredOutputManager

        self.structured_output = StructuredOutputManager(config.model)
        speculative = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            config.model.max_model_len,
            self.structured_output,
            num_lookahead_tokens=(
                speculative.num_speculative_tokens if speculative and speculative.method == "draft_model" else 0
            ),
            async_scheduling=config.async_scheduling,
            enable_kv_events=config.kv_events.publishes,
            num_offload_blocks=num_offload_blocks,
            disk_layout=disk_layout,
            kv_block_bytes=bytes_per_block,
            kv_transfer=config.kv_transfer,
        )
        self.scheduler.kv_transfer_address = kv_transfer_address
        if kv_transfer_address is not None:
            logger.info("serving finished prefills' KV blocks at %s", kv_transfer_address)
        self.kv_events = ZmqEventPublisher(config.kv_events) if config.kv_events.publishes else None
        # the launched step whose output has not been processed yet (async scheduling)
        self._in_flight: tuple[SchedulerOutput, PendingRunnerOutput] | None = None
        profile = config.profiler
        self.profiler = (
            StepProfiler(profile.directory, profile.num_steps, profile.start_step) if profile.directory else None
        )

    def _layout_fingerprint(self) -> bytes:
        """What engines must share to exchange K/V blocks (disk tier, P/D): the
        model, its cache layout, and the draft model whose caches a block also
        carries (another draft of the same shape shared the files: its K/V was
        wrong for this one, and acceptance fell from 66/66 to 31/151)."""
        config = self.config
        speculative = config.speculative
        draft = ([layout_fingerprint(speculative.model, None, [speculative.quantization]).hex()]
                 if speculative is not None and speculative.method == "draft_model" and speculative.model else [])
        return layout_fingerprint(
            config.model.model, config.model.hf_config,
            [config.model.dtype_name, config.model.quantization, config.cache.block_size,
             *self.model_runner.kv_cache_layout(), *draft],
        )

    def _disk_tier_layout(self, fingerprint: bytes, bytes_per_block: int) -> DiskTierLayout:
        config = self.config
        assert config.cache.kv_offloading_dir is not None
        layout = DiskTierLayout.create(config.cache.kv_offloading_dir, fingerprint, bytes_per_block)
        logger.info("disk KV tier: %s (%.1f GiB at most)", layout.root,
                    config.cache.kv_offloading_dir_bytes / (1 << 30))
        return layout

    def check_running(self) -> None:
        """A RuntimeError once shut down: its disk tier's threads are gone, and a request would wait on
        them for ever."""
        if self._shut_down:
            raise RuntimeError("this engine has been shut down (LLM.shutdown(), or its LLM was collected): "
                               "make a new LLM")

    def add_request(self, core_request: EngineCoreRequest) -> None:
        self.check_running()
        request = Request(core_request)
        self.scheduler.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output.add_request(request)  # compiles off the step loop

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort wherever they are; returns a final output for each one aborted."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [
            EngineCoreOutput(request.request_id, [], finish_reason="abort") for request in aborted
        ]

    @property
    def async_scheduling(self) -> bool:
        return self.config.async_scheduling

    def has_unfinished_requests(self) -> bool:
        """Work left: requests, or a step launched before its requests ended."""
        return self.scheduler.has_unfinished_requests() or self.has_step_in_flight

    @property
    def has_step_in_flight(self) -> bool:
        """Async scheduling: a step launched whose output is not processed yet."""
        return self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Schedule and run one step; return the outputs of the step that finished
        (this one, or with async scheduling usually the one before). The step's
        KV-cache events are published as one batch."""
        self.scheduler.update_kv_loads(*self.model_runner.take_finished_kv_loads())
        self.scheduler.kv_cache_manager.forget_failed_disk_writes(self.model_runner.take_failed_disk_writes())
        self._settle_kv_leases()
        outputs = self._run_step()
        runner, scheduler = self.model_runner, self.scheduler
        runner.offer_kv(scheduler.take_kv_offers())  # before the outputs naming them go out
        runner.start_remote_loads(scheduler.take_remote_loads())
        if not scheduler.has_unfinished_requests() and self._in_flight is None:
            self._flush_kv_transfers()  # idle: no step will come to write the last one's blocks
        self._publish_kv_events()
        return outputs

    def _settle_kv_leases(self) -> None:
        """Free the blocks decode engines took, and those whose lease expired or
        the pool needs (withdrawn first: no pull reads them once they are reused)."""
        if not self.scheduler.has_kv_leases:
            return
        expired = self.scheduler.expired_leases()
        if expired:
            logger.warning("%d finished prefills were not pulled in time, or the pool needed them: their "
                           "blocks are freed", len(expired))
            self.model_runner.withdraw_kv(expired)
        self.scheduler.release_leases(self.model_runner.take_released_kv() + expired)

    def _flush_kv_transfers(self) -> None:
        transfers = self.scheduler.kv_cache_manager.take_transfers(idle=True)
        if transfers:
            self.model_runner.apply_kv_transfers(transfers)

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv_cache_manager.take_events())

    def kv_events_info(self) -> dict[str, str] | None:
        """Where this engine publishes its KV-cache events (None: it does not)."""
        if self.kv_events is None:
            return None
        return {"endpoint": self.kv_events.endpoint, "replay_endpoint": self.kv_events.replay_endpoint,
                "topic": self.config.kv_events.topic, "epoch": self.kv_events.epoch}

    def shutdown(self) -> None:
        """Write the profile, publish the last events, finish the disk tier's writes and
        let go of the ports (KV events, the KV block server). Once; later calls do nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self.finish_profile()
        self._flush_kv_transfers()
        self.model_runner.close()
        self.scheduler.close()
        if self.kv_events is not None:
            self._publish_kv_events()
            self.kv_events.shutdown()

    def _run_step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            if self._in_flight is not None:
                # launched before its requests ended (a stop seen a step late, an abort): taken now, so its
                # buffers go and the idle flush writes the last blocks to the tiers, not the next request
                stale, self._in_flight = self._in_flight, None
                return self._process(*stale)
            return EngineCoreOutputs(outputs=self.scheduler.take_failure_outputs(),
                                     scheduler_stats=self.scheduler.make_stats())
        in_flight = self._in_flight
        if in_flight is not None and not self.scheduler.can_schedule_ahead():
            self._in_flight = None  # the next step needs this one's tokens on the host
            return self._process(*in_flight)
        if self.profiler is not None:
            self.profiler.before_step()
        with phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        # from here the step counts as computed: an interrupt anywhere before its forward pass has run (its
        # grammar masks, the waits, the pass itself) is undone, or its blocks stay cached unwritten
        try:
            with phase("schedule"):
                grammar = self._grammar_step(scheduler_output)
            if scheduler_output.is_empty and in_flight is None:
                self._wait_for_background_work()
            runner_output = self.model_runner.execute_model(
                scheduler_output, grammar, defer_output=self.scheduler.can_schedule_ahead()
            )
        except BaseException:  # KeyboardInterrupt offline: nothing of the step may count as computed
            try:
                self.model_runner.finish_kv_transfers(scheduler_output.kv_transfers)
            finally:
                self.scheduler.abandon_step(scheduler_output)
            raise
        self._in_flight = None
        if isinstance(runner_output, PendingRunnerOutput):
            self._in_flight = (scheduler_output, runner_output)
            # while the device runs the step just launched, process the one before; a step only launched
            # reports no tokens (its processing will: counting them now counted them twice)
            outputs = self._process(*in_flight) if in_flight is not None else EngineCoreOutputs(
                scheduler_stats=self.scheduler.make_stats()
            )
        else:
            earlier = self._process(*in_flight) if in_flight is not None else None
            outputs = self._process(scheduler_output, runner_output)
            if earlier is not None:
                outputs.outputs = earlier.outputs + outputs.outputs
                if outputs.scheduler_stats is not None and earlier.scheduler_stats is not None:
                    # one message for two steps: the earlier one's tokens were dropped (a burst's last step)
                    outputs.scheduler_stats.earlier_step_tokens = earlier.scheduler_stats.num_scheduled_tokens
        if self.profiler is not None:
            self.profiler.after_step()
        return outputs

    def _grammar_step(self, scheduler_output: SchedulerOutput) -> StructuredStep | None:
        """The grammar masks of the step's structured requests that sample (None: none)."""
        structured_ids = self.scheduler.structured_requests_to_sample(scheduler_output)
        if not structured_ids:
            return None
        bitmask = self.structured_output.bitmask(structured_ids, scheduler_output.scheduled_spec_decode_tokens)
        return StructuredStep(structured_ids, bitmask, self.structured_output.apply)

    def _wait_for_background_work(self) -> None:
        """Nothing to compute: only requests waiting for their grammars, KV loads,
        lookups or lease releases. Let those run a little."""
        if self.scheduler.is_loading_kv:
            self.model_runner.wait_for_kv_loads(timeout=0.02)
        elif self.scheduler.is_looking_up_kv:
            self.scheduler.wait_for_kv_lookups(timeout=0.02)
        elif self.scheduler.has_kv_leases:
            self.model_runner.wait_for_kv_release(timeout=0.02)
        else:
            self.structured_output.wait_for_compile(timeout=0.02)

    def _process(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | PendingRunnerOutput
    ) -> EngineCoreOutputs:
        if isinstance(runner_output, PendingRunnerOutput):
            with phase("wait_for_output"):
                runner_output = runner_output.get()
        with phase("update_from_output"):
            return self.scheduler.update_from_output(scheduler_output, runner_output)

    def finish_profile(self) -> None:
        """Write the trace now, even if the window was not complete."""
        if self.profiler is not None:
            self.profiler.finish()

    def release_remote_prefill(self, params: dict[str, Any]) -> bool:
        """Tell the prefill engine a handle names that nothing will be pulled:
        its request was refused here before it reached the scheduler (too long,
        say), and the lease held the blocks there until it expired, 30 s by
        default. Only for a handle this engine could have pulled (a consumer's
        peer): False, doing nothing, otherwise."""
        transfer = self.config.kv_transfer
        address, remote_id = params.get("remote_engine_address"), params.get("remote_request_id")
        if (transfer is None or not transfer.consumes or not params.get("do_remote_prefill")
                or not isinstance(address, str) or not address.startswith("tcp://")
                or not transfer.allows_peer(address) or not isinstance(remote_id, str)):
            return False
        self.model_runner.start_remote_loads([RemoteLoad(f"refused-{uuid.uuid4().hex}", address, remote_id, 0, [])])
        return True

    def prefix_cache_idle(self) -> bool:
        """No block is in use: a reset now would not be refused."""
        manager = self.scheduler.kv_cache_manager
        return manager.num_free_blocks == manager.num_blocks

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        if reset:
            self._flush_kv_transfers()  # the disk tier's deletes
        self._publish_kv_events()
        return reset
