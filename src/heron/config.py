"""Engine configuration: small frozen dataclasses composed into one ``EngineConfig``,
and the ``Literal`` types of every choice a user makes.

A leaf module: every layer may import it, and it imports nothing of heron's.
The values in these dataclasses are resolved and checked (``EngineArgs.
create_engine_config`` in ``heron/engine/args.py`` resolves "auto" against the
model and the machine), so the rest of the engine never re-validates them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:  # the API server process never imports torch
    import torch

SchedulingPolicy = Literal["fcfs", "priority"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
ResolvedDType = Literal["float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
ModelImpl = Literal["auto", "native", "transformers"]
AttentionBackendName = Literal["auto", "torch", "triton"]
# the CPU's weight formats with int8 inputs (models/quantization.py)
LowBitMethod = Literal["int8", "int4"]
ResolvedQuantization = Literal["none", "int8", "int4"]
Quantization = Literal["auto", "none", "int8", "int4"]
SpeculativeMethod = Literal["ngram", "draft_model"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVEventsPublisher = Literal["null", "zmq"]
DataParallelBackend = Literal["mp", "ray"]
Usage = Literal["offline", "serve"]  # serving on a CPU favours short steps (engine/args.py)

LOW_BIT_METHODS: tuple[str, ...] = get_args(LowBitMethod)


def check_choice(name: str, value: Any, literal: Any) -> None:
    """A ValueError naming the allowed values when ``value`` is not one of them."""
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in allowed)}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What model runs and how. ``hf_config`` is the transformers config object
    (from config.json or built from GGUF metadata)."""

    model: str  # resolved local path: an HF directory or a .gguf file
    served_model_name: str  # the name answers report
    source_format: Literal["hf", "gguf"]
    hf_config: Any = field(repr=False)
    dtype_name: ResolvedDType  # a name: the API server never imports torch
    max_model_len: int
    architecture: str  # the HF architecture name, e.g. "LlamaForCausalLM"
    model_impl: ModelImpl = "auto"
    quantization: ResolvedQuantization = "none"  # low-bit: CPU only, int8 inputs
    seed: int = 0
    tokenizer: str | None = None  # override; defaults to the model's own
    served_model_aliases: tuple[str, ...] = ()  # more names requests may use (--served-model-name a b)

    def __post_init__(self) -> None:
        # torch's generator takes [-2^63, 2^64); past it the engine core died at start on an "Overflow when
        # unpacking long long" that named no flag
        if not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {self.seed!r}")

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV-cache knobs.

    The pool size comes from, in order of precedence: ``num_kv_blocks``, then
    ``kv_cache_memory_bytes``, then (CPU) ``kv_cache_memory_fraction`` of the memory
    available after the weights are loaded (capped at what ``max_num_seqs`` requests
    can use at once), or (CUDA) all that ``gpu_memory_utilization`` of the device
    leaves after the weights and a profiled worst-case step.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    num_kv_blocks: int | None = None
    # CUDA: share of the device memory heron may use in all (weights, activations, KV)
    gpu_memory_utilization: float = 0.9
    # a KV offload tier in host memory beyond the pool (0: none)
    kv_offloading_bytes: int = 0
    # a KV offload tier on local disk (None: none), bounded to this many bytes
    kv_offloading_dir: str | None = None
    kv_offloading_dir_bytes: int = 16 << 30
    # a prefix block that cannot be loaded from a tier: compute it again, or fail the request
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    # the KV cache's element type (None: the model's dtype)
    kv_cache_dtype_name: ResolvedDType | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_offloading_bytes < 0:
            raise ValueError("kv_offloading_size must be >= 0")
        if (self.kv_offloading_bytes or self.kv_offloading_dir) and not self.enable_prefix_caching:
            raise ValueError("a KV offload tier keeps prefix-cache blocks: it needs prefix caching on")
        if self.kv_offloading_dir is not None and not self.kv_offloading_dir.strip():
            # an empty path started with no disk tier and no word (the engine tests its truth, this its None)
            raise ValueError("kv_offloading_dir is empty: give a directory (or leave it out for no disk tier)")
        if self.kv_offloading_dir is not None and self.kv_offloading_dir_bytes <= 0:
            raise ValueError("kv_offloading_dir_size must be positive")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure_policy must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the admission policy (docs/architecture.md, the one scheduling rule)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: SchedulingPolicy = "fcfs"
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        check_choice("scheduling_policy", self.policy, SchedulingPolicy)


@dataclass(frozen=True)
class ProfilerConfig:
    """Record engine steps ``[start_step, start_step + num_steps)`` with the torch
    profiler and write a Chrome trace into ``directory``."""

    directory: str | None = None
    num_steps: int = 32
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.start_step < 0:
            raise ValueError("profile steps must be >= 1 and the start step >= 0")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys. ``ngram``: propose the tokens that
    followed the latest earlier occurrence of the request's last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens. ``draft_model``: a
    smaller model with the same tokenizer (``model``) proposes them, optionally
    int8-quantized (``quantization``)."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    quantization: ResolvedQuantization | None = None  # the draft's; None: the target's

    @staticmethod
    def from_dict(value: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "speculative_config must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 4}"
            )
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "quantization"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            # vLLM's reading: one bound given is both (min 5 alone met the default max 4 and was refused)
            value = {**value, "prompt_lookup_max": value["prompt_lookup_min"]}
        return SpeculativeConfig(**{**value, "method": method})

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, SpeculativeMethod)
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            # each step tries every length from max down to min, each over the whole sequence: the cost grows
            # with max squared (10**6 took 2.7 s a step at 2,000 tokens)
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {MAX_PROMPT_LOOKUP}], "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config needs prompt_lookup_min <= prompt_lookup_max")
        if self.quantization is not None:
            check_choice("speculative_config.quantization", self.quantization, ResolvedQuantization)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model must be a path or model id, got {self.model!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.method 'draft_model' needs 'model' (the draft model's path)")
        if self.method == "ngram" and (self.model is not None or self.quantization is not None):
            raise ValueError("speculative_config: 'model' and 'quantization' are for method 'draft_model', "
                             "not 'ngram'")


MAX_PROMPT_LOOKUP = 32


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_peer(value: Any) -> bool:
    """``host``, ``host:port`` (a port of digits, at most 65535), an IPv6
    address in brackets (``[::1]``, ``[::1]:5000``); a bare IPv6 address is
    ambiguous and refused."""
    if not isinstance(value, str) or not value or "/" in value:
        return False
    if value.startswith("["):
        address, bracket, rest = value[1:].partition("]")
        return bool(address and bracket) and (not rest or (rest[0] == ":" and _is_port(rest[1:])))
    host, colon, port = value.partition(":")
    return bool(host) and (not colon or _is_port(port))


def _is_port(text: str) -> bool:
    return text.isdigit() and int(text) < 65536


def _flag(value: Any) -> Any:
    """true/false as JSON, Python, 1/0 or their strings (any case), as a bool; anything else as it is."""
    if isinstance(value, bool):
        return value
    spelled = str(value).strip().lower() if isinstance(value, (str, int)) else None
    return {"true": True, "1": True, "false": False, "0": False}.get(spelled, value) if spelled is not None else value


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events (core/kv_events.py), with vLLM's keys: published per engine
    step on a ZMQ PUB socket at ``endpoint``, the last ``buffer_steps`` batches
    kept for a subscriber that missed some to fetch from ``replay_endpoint``
    (default: a free port on the endpoint's host). ``hwm``: the batches the PUB
    socket queues for a subscriber that does not read (then it drops, and the
    subscriber sees the gap); ``max_queue_size``: the steps' batches waiting for
    the publishing thread (past it a batch is dropped, its number skipped)."""

    enable_kv_cache_events: bool = False
    publisher: KVEventsPublisher = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @staticmethod
    def from_dict(value: dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig:
        if value is None or isinstance(value, KVEventsConfig):
            return value or KVEventsConfig()
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a dict such as {'enable_kv_cache_events': true, "
                             "'publisher': 'zmq', 'endpoint': 'tcp://*:5557'}")
        known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                 "max_queue_size", "topic"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        merged = {**value}
        if "enable_kv_cache_events" in value:  # vLLM's config takes "true" and 1 as well: a bool, or refused
            merged["enable_kv_cache_events"] = _flag(value["enable_kv_cache_events"])
        merged = {"publisher": "zmq" if merged.get("enable_kv_cache_events") else "null", **merged}
        return KVEventsConfig(**merged)

    def __post_init__(self) -> None:
        check_choice("kv_events_config.publisher", self.publisher, KVEventsPublisher)
        # each was an AttributeError in the engine core, or (a string "false") events switched on
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        for name, optional in (("endpoint", False), ("replay_endpoint", True), ("topic", False)):
            value = getattr(self, name)
            if not isinstance(value, str) and not (optional and value is None):
                raise ValueError(f"kv_events_config.{name} must be a string{' or null' if optional else ''}, "
                                 f"got {value!r}")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv_events_config.{name} must be an integer >= {least}, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://")):
                # inproc:// is out too: the publisher's own ZMQ context is no one else's
                raise ValueError(f"kv_events_config.{name} must be a ZMQ address such as tcp://*:5557 or "
                                 f"ipc:///tmp/kv-events, got {address!r}")
            port = address.rsplit(":", 1)[-1] if address is not None and address.startswith("tcp://") else "*"
            if port != "*" and not _is_port(port):
                raise ValueError(f"kv_events_config.{name}: the port of {address!r} must be * or 0-65535")


# the names of heron's one P/D connector (blocks over TCP with ZMQ): the and vLLM-style
KV_CONNECTORS = ("tcp", "HeronConnector")
# vLLM's device-to-device connectors, named in the error that refuses them
GPU_KV_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "MooncakeConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (worker/kv_transfer.py, kv_pull.py), with vLLM's keys: a
    producer (prefill engine) keeps a finished ``do_remote_decode`` request's
    blocks for ``kv_lease_seconds`` and serves them on ``kv_ip:kv_port``
    (0: a free port); a consumer (decode engine) pulls them for a
    ``do_remote_prefill`` request, giving up when the prefill engine does not
    answer one of its pulls (32 MiB of blocks each) within ``kv_timeout_seconds``.
    ``kv_peers`` (heron's own key): the prefill engines a consumer pulls from,
    each "host" or "host:port" as handles name them; empty: any, as vLLM, but
    then what is pulled serves only the request that pulled it (a handle is
    the client's to write: one naming a server of its own would otherwise put
    its bytes in the prefix cache under another prompt's hashes)."""

    kv_connector: str = "HeronConnector"
    kv_role: KVRole = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_lease_seconds: float = 30.0
    kv_timeout_seconds: float = 30.0
    kv_peers: tuple[str, ...] = ()

    def allows_peer(self, address: str) -> bool:
        """Whether a handle's ``remote_engine_address`` (tcp://host:port) is a peer this engine pulls from."""
        if not self.kv_peers:
            return True
        host_port = address.removeprefix("tcp://")
        host = host_port.rpartition(":")[0]
        return host_port in self.kv_peers or host in self.kv_peers

    @property
    def trusts_peers(self) -> bool:
        """Whether pulled blocks may enter the prefix cache: only from peers the operator named."""
        return bool(self.kv_peers)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @staticmethod
    def from_dict(value: dict[str, Any] | KVTransferConfig | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError('kv_transfer_config must be a dict such as {"kv_connector": "HeronConnector", '
                             '"kv_role": "kv_producer"}')
        known = {field.name for field in fields(KVTransferConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}; known: {sorted(known)}")
        return KVTransferConfig(**value)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            later = (" (a GPU-to-GPU transport: not in heron yet; the block server and puller it would replace "
                     "are in docs/architecture.md)" if self.kv_connector in GPU_KV_CONNECTORS else "")
            raise ValueError(f"kv_transfer_config.kv_connector: heron has 'tcp' (alias 'HeronConnector': "
                             f"blocks over TCP with ZMQ, between CPUs or GPUs), not {self.kv_connector!r}{later}")
        check_choice("kv_transfer_config.kv_role", self.kv_role, KVRole)
        if not _is_int(self.kv_port) or not 0 <= self.kv_port < 65536:
            raise ValueError("kv_transfer_config.kv_port must be a port number (0: any free one)")
        for name in ("kv_lease_seconds", "kv_timeout_seconds"):
            # NaN passed "<= 0" and made a deadline never reached: leases held, pulls never timed out
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"kv_transfer_config.{name} must be a positive number of seconds, got {value!r}")
        peers = self.kv_peers
        if not isinstance(peers, (list, tuple)) or not all(_is_peer(p) for p in peers):
            raise ValueError('kv_transfer_config.kv_peers must be a list of "host" or "host:port" strings (IPv6 in '
                             'brackets: "[::1]:5000")')
        object.__setattr__(self, "kv_peers", tuple(peers))


def check_pool_holds_one_request(num_blocks: int, block_size: int, max_model_len: int, budget_source: str) -> None:
    """A KV pool that could not hold one request of ``max_model_len`` tokens is
    refused: such a request would wait for blocks for ever."""
    blocks_per_request = -(-max_model_len // block_size)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens, from {budget_source}) "
            f"cannot hold one request of max_model_len={max_model_len} tokens "
            f"({blocks_per_request} blocks); give it more memory or lower max_model_len"
        )


def check_request_tables_fit(max_num_seqs: int, max_model_len: int, block_size: int) -> None:
    """The runner keeps a block table row for each of ``max_num_seqs`` requests,
    as long as a ``max_model_len`` request needs: refused before the model loads
    when those rows alone would take half the host's memory (a typo such as
    ``--max-num-seqs 100000000`` would otherwise fail after the load, with a bare
    allocation error naming no option)."""
    table_bytes = max_num_seqs * -(-max_model_len // block_size) * 4  # int32 block ids
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if table_bytes > host_bytes // 2:
        raise ValueError(
            f"max_num_seqs={max_num_seqs} with max_model_len={max_model_len} needs "
            f"{table_bytes / 2**30:.1f} GiB of block tables, more than half of this host's "
            f"{host_bytes / 2**30:.1f} GiB; lower max_num_seqs (or max_model_len)"
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device_name: str  # "cpu", "cuda" or "cuda:N"
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    compile_model: bool = False  # torch.compile the forward pass (exclusive with graphs)
    speculative: SpeculativeConfig | None = None
    draft_model: ModelConfig | None = None  # the draft model of speculative "draft_model"
    # schedule and prepare step N+1 while the device runs step N (see engine/core.py)
    async_scheduling: bool = False
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation
    # engine-core processes behind one API server (heron serve), each with the whole model
    data_parallel_size: int = 1
    # where they run: processes on this host (mp), or Ray actors on a Ray cluster
    data_parallel_backend: DataParallelBackend = "mp"

    def __post_init__(self) -> None:
        check_request_tables_fit(self.scheduler.max_num_seqs, self.model.max_model_len, self.cache.block_size)
        if self.cache.num_kv_blocks is not None:  # known before the model loads: refused before it does
            check_pool_holds_one_request(self.cache.num_kv_blocks, self.cache.block_size, self.model.max_model_len,
                                         "num_kv_blocks")

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self.device_name)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the (target model's) KV cache holds: ``cache.kv_cache_dtype_name``, or the model's dtype."""
        import torch

        return getattr(torch, self.cache.kv_cache_dtype_name or self.model.dtype_name)

    def resolved_summary(self) -> dict[str, Any]:
        """The resolved values two processes resolving the same arguments must agree on."""
        model = self.model
        return {
            "model": model.model,
            "served_model_name": model.served_model_name,
            "max_model_len": model.max_model_len,
            "dtype": model.dtype_name,
            "quantization": model.quantization,
            "vocab_size": model.vocab_size,
            "device": self.device_name,
        }
