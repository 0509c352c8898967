"""``EngineArgs``: every engine knob, declared once (name, type, default, help).

The command-line flags of ``heron serve`` / ``generate`` / ``chat`` / ``bench`` /
``convert`` are built from these fields (``add_cli_args``), ``LLM(**kwargs)``
accepts exactly these fields, and ``create_engine_config`` resolves the "auto"
values against the model and the machine and validates everything, giving the
frozen ``EngineConfig`` the engine runs on. Flag names follow vLLM's, so
commands carry over.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import secrets
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from heron.config import (
    AttentionBackendName,
    CacheConfig,
    DataParallelBackend,
    Device,
    DType,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ModelImpl,
    ProfilerConfig,
    Quantization,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    Usage,
    check_choice,
)
from heron.engine.resolve import (
    architecture_of,
    draft_model_config,
    dtype_flag,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_max_model_len,
    resolve_quantization,
)
from heron.loader.model_config import load_hf_config
from heron.loader.model_source import resolve_model_source, resolve_tokenizer_source


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '1e9' -> bytes (a whole, finite, non-negative number
    of them: 'inf' was an OverflowError traceback, and a negative size was
    taken, so that a header limit of -1 refused every request)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    number, factor = lowered, 1
    for suffix, unit in units.items():
        if lowered.endswith(suffix):
            number, factor = lowered[: -len(suffix)], unit
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB, 2GB or 1e9, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite size of at least 0 bytes, got {text!r}")
    return int(value)


def positive_size(text: str) -> int:
    """``parse_size`` of at least one byte (a limit of 0 refused everything)."""
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return size


def parse_seed(text: str) -> int | None:
    """--seed: an integer, or 'random' (None: a new seed each start)."""
    if text.strip().lower() in ("random", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'random', got {text!r}") from None


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _arg(default: Any, help: str, *, flags: tuple[str, ...] = (), parse: Any = None, cli: bool = True,
         metavar: str | None = None, nargs: str | None = None) -> Any:
    """A field of ``EngineArgs`` with its command-line spelling. ``flags``: the
    option strings (default ``--field-name``); ``parse``: the argparse type when
    the field's type does not say it; ``nargs``: argparse's, for a flag that
    takes several values."""
    metadata = {"help": help, "flags": flags, "parse": parse, "cli": cli, "metavar": metavar, "nargs": nargs}
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """Unresolved engine arguments, as a user gives them. ``dtype`` also takes a
    ``torch.dtype`` and the short spellings ("bf16", "fp32", ...) from Python;
    ``device`` also takes "cuda:N"."""

    model: str | None = _arg(None, "HF directory, .gguf file or hub id (default: the embedded "
                                   "SmolLM2-135M-Instruct)")
    tokenizer: str | None = _arg(None, "tokenizer to use instead of the model's own")
    served_model_name: str | list[str] | None = _arg(
        None, "the model's name in the API (default: the model's); several names are aliases a request may "
              "use, the first is the one answers report", parse=str, nargs="+", metavar="NAME")
    dtype: DType = _arg("auto", "activation and weight dtype (float32/float/fp32, bfloat16/bf16, float16/half/fp16); "
                                "auto: float32 on CPUs without native bf16 and for low-bit weights, bfloat16 on "
                                "CUDA and bf16 CPUs", parse=dtype_flag, metavar="DTYPE")
    max_model_len: int | None = _arg(None, "context length (default: the model's)")
    max_num_seqs: int | None = _arg(None, "running sequences per step (default: 256 on CUDA, 64 on CPU)")
    max_num_batched_tokens: int | None = _arg(
        None, "tokens per step (default: 2048; 512 when serving on a CPU, so decodes wait less behind a prompt)")
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV of a shared prompt prefix")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over several steps")
    kv_cache_memory_bytes: int | None = _arg(None, "KV-cache budget, e.g. 2GiB", parse=parse_size, metavar="SIZE")
    kv_offloading_size: float = _arg(0.0, "GiB of host memory for a KV offload tier: prefix blocks evicted from the "
                                          "pool are kept there and loaded back instead of recomputed (0: none)",
                                     metavar="GIB")
    kv_offloading_dir: str | None = _arg(None, "directory of a local-disk KV offload tier: every full prefix block is "
                                               "written there once computed (write-through), survives a restart and "
                                               "is shared by every replica pointed at the same directory",
                                         metavar="DIR")
    kv_offloading_dir_size: float = _arg(16.0, "GiB the disk tier may fill before it deletes its least recently "
                                               "used blocks", metavar="GIB")
    kv_load_failure_policy: Literal["recompute", "fail"] = _arg(
        "recompute", "a prefix block an offload tier cannot deliver (deleted, corrupt): compute it again, or fail "
                     "the request")
    kv_cache_dtype: DType = _arg("auto", "what the KV cache holds (the dtype spellings); auto: float16 for the CPU's "
                                         "low-bit modes (half the bytes decode attention reads), else the model's "
                                         "dtype", parse=dtype_flag, metavar="DTYPE")
    kv_cache_memory_fraction: float = _arg(0.25, "CPU: share of the memory left after the weights for the KV cache")
    num_kv_blocks: int | None = _arg(None, "KV-cache blocks (overrides the memory budgets)")
    scheduling_policy: SchedulingPolicy = _arg("fcfs", "admission order: first come first served, or by "
                                                       "request priority")
    seed: int | None = _arg(0, "seed of the random generator of requests sampled without a seed of their own "
                                "('random', or None in Python: a different one each start, as in vLLM)",
                            parse=parse_seed)
    device: Device = _arg("auto", "where the model runs (auto: CUDA when present)")
    model_impl: ModelImpl = _arg("auto", "heron's own implementation (the Llama family) or transformers'")
    attention_backend: AttentionBackendName = _arg("auto", "attention kernels (auto: torch on CPU, triton on CUDA)")
    enforce_eager: bool = _arg(False, "no CUDA graphs")
    compile_model: bool = _arg(False, "torch.compile the forward pass (instead of CUDA graphs)",
                               flags=("--compile-model", "--compile"))
    gpu_memory_utilization: float = _arg(0.9, "CUDA: share of the device memory heron may use in all")
    quantization: Quantization = _arg(
        "auto", "CPU low-bit weights with int8 inputs: int8 per output channel, or int4 in blocks of 32 (the LM "
                "head int8); auto: the format matching a GGUF's Q4_0/Q4_1/Q8_0 weights on a CPU with AVX2, else none")
    speculative_config: dict[str, Any] | None = _arg(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
        parse=parse_json_object, metavar="JSON")
    async_scheduling: bool | None = _arg(None, "schedule step N+1 while the device runs step N (default: on "
                                               "for CUDA without speculative decoding)")
    kv_events_config: dict[str, Any] | None = _arg(
        None, 'publish KV-cache events for a KV-aware router, e.g. \'{"enable_kv_cache_events": true, '
              '"publisher": "zmq", "endpoint": "tcp://*:5557"}\'', parse=parse_json_object, metavar="JSON")
    kv_transfer_config: dict[str, Any] | None = _arg(
        None, 'prefill/decode disaggregation: this engine serves finished prefills to decode engines and/or '
              'pulls them, e.g. \'{"kv_connector": "tcp", "kv_role": "kv_both"}\'',
        parse=parse_json_object, metavar="JSON")
    data_parallel_size: int = _arg(
        1, "heron serve: engine-core processes behind the one API server, each request placed where its prefix "
           "is cached unless that engine is much busier")
    data_parallel_backend: DataParallelBackend = _arg(
        "mp", "heron serve: where the engine cores run: mp (processes on this host) or ray (Ray actors on the "
              "running Ray cluster at RAY_ADDRESS, placed by a placement group; pip install 'heron[ray]')")
    profile_dir: str | None = _arg(None, "write a torch profiler trace of engine steps here",
                                   flags=("--profile",), metavar="DIR")
    profile_steps: int = _arg(32, "how many engine steps to profile")
    usage: Usage = _arg("offline", "what the engine is for (set by the command)", cli=False)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add a flag for every field (an "engine" argument group)."""
        group = parser.add_argument_group("engine")
        hints = get_type_hints(EngineArgs)
        for spec in fields(EngineArgs):
            if spec.metadata["cli"]:
                flags = spec.metadata["flags"] or ("--" + spec.name.replace("_", "-"),)
                group.add_argument(*flags, dest=spec.name, default=spec.default,
                                   **_argparse_options(hints[spec.name], spec.metadata))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, usage: Usage = "offline") -> EngineArgs:
        names = [spec.name for spec in fields(cls) if spec.metadata["cli"]]
        return cls(**{name: getattr(args, name) for name in names}, usage=usage)

    @classmethod
    def from_kwargs(cls, caller: str, **kwargs: Any) -> EngineArgs:
        """``EngineArgs(**kwargs)`` with an error that lists the known names."""
        known = {spec.name: spec for spec in fields(cls)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise TypeError(f"{caller} got unknown engine argument(s) {unknown}; known: {sorted(known)}")
        hints = get_type_hints(cls)
        return cls(**{name: _checked_kwarg(caller, name, value, hints[name], known[name].metadata)
                      for name, value in kwargs.items()})

    def create_engine_config(self) -> EngineConfig:
        """Resolve "auto" values against the model and the machine, validating all."""
        for name in ("model", "tokenizer", "profile_dir"):
            if getattr(self, name, None) == "":  # an unset shell variable: the default served in silence
                raise ValueError(f"{name} is an empty string (an unset variable?); leave it out for the default")
        for name, literal in (("attention_backend", AttentionBackendName), ("model_impl", ModelImpl),
                              ("usage", Usage), ("data_parallel_backend", DataParallelBackend)):
            check_choice(name, getattr(self, name), literal)
        device = resolve_device(self.device)
        model_config = self._model_config(device)
        speculative = SpeculativeConfig.from_dict(self.speculative_config)
        draft_model = draft_model_config(speculative, model_config) if speculative else None
        if draft_model is not None and draft_model.quantization != "none" and device != "cpu":
            raise ValueError(f"speculative_config.quantization={draft_model.quantization!r} runs on the CPU only")
        if model_config.quantization != "none" and device != "cpu":
            raise ValueError(f"quantization={model_config.quantization!r} runs on the CPU only; use bfloat16 on CUDA")
        if self.async_scheduling and speculative is not None:
            raise ValueError("async_scheduling does not support speculative decoding yet; turn one of them off")
        if device == "cpu" and self.attention_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            # it failed in the engine core, a traceback (the CPU tests run the kernels in Triton's interpreter)
            raise ValueError("attention_backend 'triton' runs on CUDA only; use 'torch' (or 'auto') on the CPU")
        if device == "cpu" and self.compile_model:  # a Dynamo guard failure on the low-bit path, minutes elsewhere
            raise ValueError("compile_model runs on CUDA only (the CPU paths are C kernels and torch ops already)")
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            # overlapping needs a device that runs beside the host: on a CPU both are the same cores
            async_scheduling = device.startswith("cuda") and speculative is None
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                kv_offloading_bytes=_gib_to_bytes(self.kv_offloading_size, "kv_offloading_size"),
                kv_offloading_dir=self.kv_offloading_dir,
                kv_offloading_dir_bytes=_gib_to_bytes(self.kv_offloading_dir_size, "kv_offloading_dir_size"),
                kv_load_failure_policy=self.kv_load_failure_policy,
                kv_cache_dtype_name=resolve_kv_cache_dtype(self.kv_cache_dtype, device, model_config,
                                                           self.attention_backend),
                kv_cache_memory_fraction=self.kv_cache_memory_fraction,
                num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=self._scheduler_config(device, model_config.max_model_len),
            device_name=device,
            profiler=ProfilerConfig(directory=self.profile_dir, num_steps=self.profile_steps),
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager or self.compile_model,
            compile_model=self.compile_model,
            speculative=speculative,
            draft_model=draft_model,
            async_scheduling=async_scheduling,
            kv_events=KVEventsConfig.from_dict(self.kv_events_config),
            kv_transfer=KVTransferConfig.from_dict(self.kv_transfer_config),
            data_parallel_size=self._data_parallel_size(),
            data_parallel_backend=self._data_parallel_backend(),
        )

    def _data_parallel_size(self) -> int:
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.data_parallel_size > 1 and self.usage != "serve":
            raise ValueError("data_parallel_size > 1 runs behind heron serve (several engine-core processes); "
                             "offline LLM runs one engine")
        return self.data_parallel_size

    def _data_parallel_backend(self) -> DataParallelBackend:
        if self.data_parallel_backend == "ray" and self.usage != "serve":
            raise ValueError("data_parallel_backend ray runs behind heron serve; offline LLM runs one local engine")
        return self.data_parallel_backend

    def _model_config(self, device: str) -> ModelConfig:
        from heron.models.implementation import select_implementation

        source = resolve_model_source(self.model)
        quantization = resolve_quantization(self.quantization, self.dtype, device, source)
        hf_config = load_hf_config(source, self.model_impl)
        names = served_model_names(self.served_model_name) or (source.name,)
        model_config = ModelConfig(
            model=source.path,
            served_model_name=names[0],
            served_model_aliases=names[1:],
            source_format=source.format,
            hf_config=hf_config,
            dtype_name=resolve_dtype(self.dtype, device, quantization),
            max_model_len=resolve_max_model_len(self.max_model_len, hf_config),
            architecture=architecture_of(hf_config),
            model_impl=self.model_impl,
            quantization=quantization,
            seed=self.seed if self.seed is not None else secrets.randbits(63),
            tokenizer=resolve_tokenizer_source(self.tokenizer) if self.tokenizer else None,
        )
        select_implementation(model_config)  # unsupported architectures fail here, early
        return model_config

    def _scheduler_config(self, device: str, max_model_len: int) -> SchedulerConfig:
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            # a GPU step reads the weights once for the whole batch: wide batches are
            # nearly free there (vLLM's default is 256 too); a CPU step's cost grows with it
            max_num_seqs = 256 if device.startswith("cuda") else 64
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # Serving on a CPU: the budget bounds how long running decodes wait behind
            # a new prompt; a 512-token step takes about a second and keeps 95% of the
            # prefill rate of 2048-token steps. Offline, nobody waits: take the rate.
            serving_cpu = self.usage == "serve" and device == "cpu"
            max_num_batched_tokens = max(512 if serving_cpu else 2048, max_num_seqs)
            if not self.enable_chunked_prefill:  # a whole prompt in one step: any the context holds
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        elif not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # a longer prompt (or a preempted request's prompt and output) would wait at the head of the
            # queue for ever, and every request behind it with it
            raise ValueError(f"without chunked prefill a prompt is computed in one step: max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be at least max_model_len ({max_model_len})")
        return SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )


def served_model_names(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """--served-model-name's names, in order, or () for the model's own: each a
    non-empty string (an unset shell variable served the default in silence),
    none twice."""
    if value is None:
        return ()
    if not isinstance(value, (str, list, tuple)):
        raise TypeError(f"served_model_name must be a string or a list of strings, got {type(value).__name__} "
                        f"{value!r}")
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names:
        raise ValueError("served_model_name is an empty list; leave it out for the model's own name")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"served_model_name must be a string or a list of strings, got {type(name).__name__} "
                            f"{name!r}")
        if not name:
            raise ValueError("served_model_name is an empty string (an unset variable?); leave it out for the "
                             "model's own name")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"served_model_name names {repeated} more than once")
    return names


def _argparse_options(hint: Any, metadata: Any) -> dict[str, Any]:
    """argparse keywords for a field of type ``hint``: booleans get --x/--no-x,
    ``Literal`` types their values as choices."""
    options: dict[str, Any] = {"help": metadata["help"]}
    if metadata["metavar"]:
        options["metavar"] = metadata["metavar"]
    if metadata["nargs"]:
        options["nargs"] = metadata["nargs"]
    base = _without_none(hint)
    if base is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif metadata["parse"] is not None:
        options["type"] = metadata["parse"]
    elif get_origin(base) is Literal:
        options["choices"] = list(get_args(base))
    elif base in (int, float, str):
        options["type"] = base
    else:
        raise TypeError(f"EngineArgs: no command-line parser for {hint!r}; give the field parse=")
    return options


def _checked_kwarg(caller: str, name: str, value: Any, hint: Any, metadata: Any) -> Any:
    """A Python keyword's value for field ``name``: a string for a field with a
    parser of its own is parsed as its flag is (``kv_cache_memory_bytes="2GiB"``);
    a number, a bool, a string or a dict of the wrong type is a TypeError naming
    the field (one was a TypeError deep in the config, ``max_num_seqs=2.5`` one
    in the block table, and ``enable_prefix_caching="false"`` turned it on).
    ``Literal`` fields are checked when the arguments are resolved."""
    base = _without_none(hint)
    if value is None and base is not hint:
        return None
    if base is str and isinstance(value, os.PathLike):  # a pathlib.Path for a directory or file
        value = os.fspath(value)
    if base is bool and getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy's bool
        value = bool(value)
    if isinstance(value, str) and metadata["parse"] is not None:
        try:
            return metadata["parse"](value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{caller} {name}: {exc}") from exc
    accepted: tuple[type, ...] | None = {bool: (bool,), int: (numbers.Integral,), float: (numbers.Real,),
                                          str: (str,)}.get(base)
    if base is dict or get_origin(base) is dict:
        accepted = (dict,)
    if accepted is None:
        return value
    if not isinstance(value, accepted) or (isinstance(value, bool) and base is not bool):
        what = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}.get(base, "a dict")
        raise TypeError(f"{caller} {name} must be {what}{' or None' if base is not hint else ''}, "
                        f"got {type(value).__name__} {value!r}")
    number: Any = value  # isinstance against a tuple of types left mypy an object
    return int(number) if base is int else float(number) if base is float else value


def _without_none(hint: Any) -> Any:
    """``X | None`` -> ``X``."""
    if get_origin(hint) in (Union, types.UnionType):
        remaining = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(remaining) == 1:
            return remaining[0]
    return hint


def _gib_to_bytes(gib: float, name: str) -> int:
    """A size in GiB as bytes; a ValueError naming the option for one that is no
    size (inf was an OverflowError traceback, nan a sentence naming nothing)."""
    if not math.isfinite(gib) or gib < 0:
        raise ValueError(f"{name} must be a finite number of GiB >= 0, got {gib}")
    return int(gib * (1 << 30))
