"""The offline Python API, in vLLM's shape::

    from heron import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from heron.config import EngineConfig
from heron.engine.args import EngineArgs
from heron.engine.input_processor import ProcessedPrompt
from heron.engine.llm_engine import LLMEngine
from heron.engine.tool_prompting import template_messages
from heron.outputs import RequestOutput
from heron.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """``model`` and any ``EngineArgs`` field as a keyword (``heron/engine/args.py``
        lists them with their defaults), e.g. ``LLM(max_model_len=4096, seed=1)``."""
        config = EngineArgs.from_kwargs("LLM()", model=model, **engine_args).create_engine_config()
        self.engine = LLMEngine(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an already resolved configuration."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def shutdown(self) -> None:
        """Finish the disk tier's writes, write the profile and let go of the ports this
        engine holds (KV events, the KV block server). Also done when the LLM is collected
        or the interpreter exits, or at the end of ``with LLM(...) as llm:``."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the pool's and the offload tiers' (a disk
        tier's files too), as vLLM's ``LLM.reset_prefix_cache``: to measure
        without a warm cache. False, and nothing forgotten, while a request
        holds blocks (only from another thread: ``generate`` returns idle)."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts (strings, token-id lists, or
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts, which may carry a
        ``cache_salt``: prompts of different salts share no cached prefix). Outputs
        come back in prompt order."""
        processor = self.engine.input_processor
        prompt_list = _as_prompt_list(prompts)
        processed = [processor.process_prompt(prompt) for prompt in prompt_list]
        return self._run(processed, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations, each a
        list of ``{"role": ..., "content": ...}`` messages. ``tools`` (OpenAI's
        function definitions) and the conversation's calls and results are
        prepared as the server prepares them (``template_messages``): a template
        that takes ``tools`` gets them, and past calls' arguments as objects;
        another gets them written into the messages. The reply is text (parse
        calls from it as you would)."""
        template = chat_template or getattr(self.engine.tokenizer, "chat_template", None)
        conversations: Sequence[Conversation]
        if not messages:  # as generate([]): an empty list was answered [] without a word
            raise ValueError("no conversations given")
        if isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        processor = self.engine.input_processor
        processed = []
        for conversation in conversations:
            prepared, tool_kwargs = template_messages(list(conversation), tools or None, template)
            processed.append(processor.process_chat(
                prepared,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs={**(chat_template_kwargs or {}), **tool_kwargs} or None,
            ))
        return self._run(processed, sampling_params, use_tqdm, None)

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(
                f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                "pass one, or one per prompt"
            )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.engine
        request_ids = []
        # validate every request before adding any, so bad input wastes no work
        for prompt, params in zip(prompts, params_list):
            engine.input_processor.make_requests("validation", prompt, params, cache_salt=prompt.cache_salt)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(
            total=len(prompts),
            desc="Processed prompts",
            disable=not use_tqdm or len(prompts) < 2,
            dynamic_ncols=True,
        )
        try:  # from the first request added: an interrupt while adding left the ones added running
            for index, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = engine.next_request_id()
                request_ids.append(request_id)
                engine.add_request(
                    request_id,
                    prompt,
                    params.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                    priority=priority[index] if priority is not None else 0,
                    cache_salt=prompt.cache_salt,
                )
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            for request_id, params in zip(request_ids, params_list):
                engine.abort_request(request_id, params.n)  # finished ones too: the core may still hold them
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a token-id list, a dict) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # a single prompt of token ids
        if not prompts:
            raise ValueError("no prompts given")
        return list(prompts)
    raise TypeError(f"prompts must be a string, token ids, or a list of them, not {type(prompts).__name__}")
