"""The synchronous, in-process engine: input processor -> engine core -> output
processor. The offline ``LLM`` and the terminal CLI drive it step by step."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from heron.config import EngineConfig
from heron.engine.core import EngineCore
from heron.engine.input_processor import InputProcessor, ProcessedPrompt, child_request_id
from heron.engine.output_processor import OutputProcessor
from heron.loader.tokenizer import load_tokenizer
from heron.outputs import RequestOutput
from heron.profiling import phase
from heron.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.input_processor = InputProcessor(config.model, self.tokenizer, config.scheduler.policy == "priority")
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)
        self._ids = itertools.count()
        # shuts the engine core down when this engine is collected, or at the interpreter's exit: a dropped
        # offline engine lost the disk tier's queued writes, kept its ports (KV events, the KV block
        # server) bound and its profiler running (the finalizer holds the core, never this engine)
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

    def shutdown(self) -> None:
        """Shut the engine core down now (``EngineCore.shutdown``); once, whoever calls first."""
        self._finalizer()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.engine_core.check_running()  # before its prompt is registered for output
        core_requests = self.input_processor.make_requests(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        self.output_processor.add_request(request_id, prompt, params)
        for core_request in core_requests:
            self.engine_core.add_request(core_request)

    def abort_request(self, request_id: str, num_samples: int = 1) -> None:
        """Abort a request in the engine core too, even where the front end has
        already let it go (a stop string finished it in a step that an interrupt
        cut short before the core heard): ``num_samples`` is its ``n``."""
        engine_ids = set(self.output_processor.abort_request(request_id))
        engine_ids.update([request_id] if num_samples == 1 else
                          [child_request_id(request_id, index) for index in range(num_samples)])
        self.engine_core.abort_requests(sorted(engine_ids))

    def reset_prefix_cache(self) -> bool:
        """``EngineCore.reset_prefix_cache``: False (nothing forgotten) while a request holds blocks."""
        return self.engine_core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (async scheduling) a step launched after the last one finished."""
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_step_in_flight

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        with phase("process_outputs"):
            processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.request_ids_to_abort:
            self.engine_core.abort_requests(processed.request_ids_to_abort)
        return processed.request_outputs
