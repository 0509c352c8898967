"""Defaults that depend on the device and the use (EngineArgs.create_engine_config)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from heron.engine.args import EngineArgs


def test_cpu_defaults_for_offline_use_and_serving():
    offline = EngineArgs(device="cpu").create_engine_config()
    assert offline.scheduler.max_num_seqs == 64 and offline.scheduler.max_num_batched_tokens == 2048
    serving = EngineArgs(device="cpu", usage="serve").create_engine_config()
    assert serving.scheduler.max_num_batched_tokens == 512  # bounds a decode's wait behind a prompt
    wide = EngineArgs(device="cpu", usage="serve", max_num_seqs=600).create_engine_config()
    assert wide.scheduler.max_num_seqs == 600 and wide.scheduler.max_num_batched_tokens == 600
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(device="cpu", max_num_seqs=0).create_engine_config()


def test_without_chunked_prefill_a_step_holds_any_prompt():
    """A prompt longer than the step budget waited at the head of the queue for
    ever (and every request behind it): `heron serve --no-enable-chunked-prefill`
    hung on the first prompt past 512 tokens."""
    whole = EngineArgs(device="cpu", usage="serve", enable_chunked_prefill=False, max_model_len=4096)
    assert whole.create_engine_config().scheduler.max_num_batched_tokens == 4096
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) must be at least max_model_len \(4096\)"):
        EngineArgs(device="cpu", enable_chunked_prefill=False, max_model_len=4096,
                   max_num_batched_tokens=512).create_engine_config()


@pytest.mark.parametrize("native_bf16", [False, True])
def test_default_is_the_low_bit_fast_path_on_every_cpu(monkeypatch, native_bf16):
    """The embedded Q4_1 GGUF runs in int4 on float32 activations whether or not
    the CPU has native bf16 (on one that has, "auto" once gave bf16 and the native
    decode path switched itself off); unquantized, "auto" follows the CPU."""
    import torch

    from heron.engine import resolve
    from heron.kernels.cpu import isa

    monkeypatch.setattr(resolve, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar", "avx2"])  # what the CPU is does not matter here
    default = EngineArgs(device="cpu").create_engine_config()
    assert (default.model.quantization, default.model.dtype) == ("int4", torch.float32)
    plain = EngineArgs(device="cpu", quantization="none").create_engine_config()
    assert plain.model.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    explicit = EngineArgs(device="cpu", dtype="bfloat16").create_engine_config()
    assert (explicit.model.quantization, explicit.model.dtype) == ("none", torch.bfloat16)


def test_auto_quantization_needs_vectorized_kernels(monkeypatch):
    """Without AVX2 the low-bit kernels would run their portable reference (20-90x
    slower than AVX2's): "auto" keeps such a CPU unquantized."""
    from heron.kernels.cpu import isa

    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar"])
    assert EngineArgs(device="cpu").create_engine_config().model.quantization == "none"


def test_low_bit_modes_keep_a_float16_kv_cache_unless_asked_otherwise(monkeypatch):
    """"auto": the CPU's low-bit modes store K/V as float16 (half the bytes their
    attention reads); unquantized models keep their own dtype; an explicit choice
    wins, and a cache dtype other than the model's is refused off the CPU."""
    from types import SimpleNamespace

    import torch

    from heron.engine.resolve import resolve_kv_cache_dtype
    from heron.kernels.cpu import isa

    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar", "avx2"])
    default = EngineArgs(device="cpu").create_engine_config()
    assert default.model.quantization == "int4" and default.kv_cache_dtype == torch.float16
    plain = EngineArgs(device="cpu", quantization="none", dtype="float32").create_engine_config()
    assert plain.kv_cache_dtype == torch.float32
    opted_out = EngineArgs(device="cpu", kv_cache_dtype="float32").create_engine_config()
    assert opted_out.kv_cache_dtype == torch.float32 and opted_out.cache.kv_cache_dtype_name is None
    gpu_model = SimpleNamespace(quantization="none", dtype_name="bfloat16")
    assert resolve_kv_cache_dtype("auto", "cuda", gpu_model) is None
    assert resolve_kv_cache_dtype("bfloat16", "cuda", gpu_model) is None
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("float16", "cuda", gpu_model)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(device="cpu", kv_cache_dtype="int3").create_engine_config()


def test_the_triton_kernel_in_the_cpus_interpreter_keeps_the_models_kv_dtype(monkeypatch):
    """Its dots take one dtype: the low-bit default's float16 cache under float32
    activations failed at the first step with the interpreter's assertion (found
    by the Triton review); a differing dtype asked for is refused up front."""
    import torch

    from heron.kernels.cpu import isa

    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar", "avx2"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    default = EngineArgs(device="cpu", attention_backend="triton").create_engine_config()
    assert default.model.quantization == "int4" and default.kv_cache_dtype == torch.float32
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float16' differs .* with attention_backend 'triton'"):
        EngineArgs(device="cpu", attention_backend="triton", kv_cache_dtype="float16").create_engine_config()


def test_every_engine_argument_has_one_flag_built_from_its_field():
    """The flags come from EngineArgs' fields: types, choices and defaults are
    the fields' own, so the CLI and LLM(**kwargs) cannot drift apart."""
    import argparse
    from dataclasses import fields

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert defaults == EngineArgs()
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--no-enable-prefix-caching", "--kv-cache-memory-bytes", "2GiB", "--compile", "--quantization", "int8",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--profile", "/tmp/p",
         "--max-num-seqs", "8", "--kv-cache-memory-fraction", "0.5"]), usage="serve")
    assert (args.enable_prefix_caching, args.kv_cache_memory_bytes, args.compile_model) == (False, 2 << 30, True)
    assert (args.quantization, args.profile_dir, args.max_num_seqs, args.usage) == ("int8", "/tmp/p", 8, "serve")
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert args.kv_cache_memory_fraction == 0.5
    dests = {action.dest for action in parser._actions}
    assert {spec.name for spec in fields(EngineArgs)} - dests == {"usage"}
    for bad in (["--quantization", "int3"], ["--attention-backend", "cuda"], ["--speculative-config", "[1]"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


@pytest.mark.parametrize("keyword, message", [
    ({"max_model_len": "128"}, "max_model_len must be an integer or None, got str '128'"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer or None, got float 2.5"),
    ({"block_size": True}, "block_size must be an integer, got bool True"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be True or False, got str 'false'"),
    ({"kv_offloading_size": "2"}, "kv_offloading_size must be a number, got str '2'"),
    ({"kv_transfer_config": [1]}, "kv_transfer_config must be a dict or None, got list"),
])
def test_a_python_keyword_of_the_wrong_type_is_named(keyword, message):
    """From Python nothing checked the types: a TypeError deep in the config or
    the block table, and enable_prefix_caching="false" left it on."""
    with pytest.raises(TypeError) as raised:
        EngineArgs.from_kwargs("LLM()", **keyword)
    assert str(raised.value) == f"LLM() {message}" or message in str(raised.value)


def test_a_python_keyword_is_parsed_as_its_flag_is_where_it_has_a_parser():
    args = EngineArgs.from_kwargs("LLM()", kv_cache_memory_bytes="2GiB", max_model_len=np.int64(64),
                                  kv_offloading_size=1, seed=None, model=Path("/models/a"),
                                  kv_offloading_dir=Path("/tmp/tier"), enable_prefix_caching=np.bool_(False),
                                  dtype=torch.float32)
    assert args.kv_cache_memory_bytes == 2 << 30 and args.max_model_len == 64 and type(args.max_model_len) is int
    assert args.kv_offloading_size == 1.0 and args.seed is None
    assert args.model == "/models/a" and args.kv_offloading_dir == "/tmp/tier"  # a Path worked before the checks
    assert args.enable_prefix_caching is False and args.dtype is torch.float32
    with pytest.raises(ValueError, match="LLM\\(\\) kv_cache_memory_bytes: "):
        EngineArgs.from_kwargs("LLM()", kv_cache_memory_bytes="lots")


def test_unknown_or_invalid_engine_arguments_are_named():
    from heron.engine.llm import LLM

    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['max_seqs'\]"):
        LLM(max_seqs=4)
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'triton'"):
        EngineArgs(attention_backend="flash").create_engine_config()
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3").create_engine_config()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineArgs(device="cpu", scheduling_policy="lifo").create_engine_config()


def test_data_parallelism_is_for_the_server():
    assert EngineArgs(device="cpu", usage="serve", data_parallel_size=2).create_engine_config().data_parallel_size == 2
    with pytest.raises(ValueError, match="runs behind heron serve"):
        EngineArgs(device="cpu", data_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineArgs(device="cpu", usage="serve", data_parallel_size=0).create_engine_config()


def test_kv_transfer_config_takes_vllm_keys_and_refuses_what_heron_lacks():
    import pytest

    from heron.config import KVTransferConfig

    config = KVTransferConfig.from_dict({"kv_connector": "HeronConnector", "kv_role": "kv_producer", "kv_port": 0})
    assert config is not None and config.produces and not config.consumes
    assert KVTransferConfig.from_dict(None) is None
    tcp = KVTransferConfig.from_dict({"kv_connector": "tcp", "kv_role": "kv_consumer"})  # the name
    assert tcp is not None and tcp.consumes
    with pytest.raises(ValueError, match="GPU-to-GPU transport: not in heron yet"):
        KVTransferConfig.from_dict({"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match="heron has 'tcp'"):
        KVTransferConfig.from_dict({"kv_connector": "SharedStorageConnector"})
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_dict({"kv_rank": 0})
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_dict({"kv_role": "prefill"})
    with pytest.raises(ValueError, match="kv_lease_seconds"):
        KVTransferConfig.from_dict({"kv_lease_seconds": 0})
    # NaN made a deadline never reached (leases held, pulls never timing out); true was port 1
    for bad, key in (({"kv_lease_seconds": float("nan")}, "kv_lease_seconds"),
                     ({"kv_timeout_seconds": True}, "kv_timeout_seconds"), ({"kv_port": True}, "kv_port"),
                     ({"kv_peers": ["host:abc"]}, "kv_peers"), ({"kv_peers": ["2001:db8::1"]}, "kv_peers")):
        with pytest.raises(ValueError, match=f"kv_transfer_config.{key}"):
            KVTransferConfig.from_dict(bad)
    assert KVTransferConfig.from_dict({"kv_role": "kv_consumer", "kv_peers": ["[::1]:5000", "h:1", "h"]}) is not None


@pytest.mark.parametrize("value, key", [
    ({"enable_kv_cache_events": True, "endpoint": 5}, "endpoint"),  # an AttributeError traceback at start
    ({"enable_kv_cache_events": True, "endpoint": None}, "endpoint"),  # the engine core died on it
    ({"enable_kv_cache_events": True, "topic": 5}, "topic"),
    ({"enable_kv_cache_events": "no"}, "enable_kv_cache_events"),  # a string switched events on
])
def test_kv_events_config_values_are_checked_by_type(value, key):
    from heron.config import KVEventsConfig

    with pytest.raises(ValueError, match=f"kv_events_config.{key} must be"):
        KVEventsConfig.from_dict(value)


def test_kv_peers_bound_where_a_consumer_pulls_from():
    from types import SimpleNamespace

    import pytest

    from heron.config import KVTransferConfig
    from heron.entrypoints.openai.errors import APIError
    from heron.entrypoints.openai.protocol import CompletionRequest
    from heron.entrypoints.openai.serving_common import check_kv_transfer_params

    anyone = KVTransferConfig.from_dict({"kv_role": "kv_consumer"})
    assert anyone is not None and anyone.allows_peer("tcp://198.51.100.7:9")
    config = KVTransferConfig.from_dict({"kv_role": "kv_consumer", "kv_peers": ["prefill-a", "10.0.0.5:7000"]})
    assert config is not None and config.kv_peers == ("prefill-a", "10.0.0.5:7000")
    assert config.allows_peer("tcp://prefill-a:41234") and config.allows_peer("tcp://10.0.0.5:7000")
    assert not config.allows_peer("tcp://10.0.0.5:7001") and not config.allows_peer("tcp://prefill-b:41234")
    assert not config.allows_peer("tcp://prefill-a.evil:1")
    for bad in ("prefill-a", ["tcp://prefill-a:1"], [""], [3]):
        with pytest.raises(ValueError, match="kv_peers"):
            KVTransferConfig.from_dict({"kv_peers": bad})
    ctx = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(kv_transfer=config)))
    handle = {"do_remote_prefill": True, "remote_request_id": "r", "remote_num_blocks": 1, "remote_block_size": 16}
    check_kv_transfer_params(ctx, CompletionRequest(prompt="x", kv_transfer_params={
        **handle, "remote_engine_address": "tcp://prefill-a:5"}))
    with pytest.raises(APIError, match="not among this server's kv_peers"):
        check_kv_transfer_params(ctx, CompletionRequest(prompt="x", kv_transfer_params={
            **handle, "remote_engine_address": "tcp://203.0.113.9:5"}))


def test_a_client_request_id_names_the_answer_and_an_empty_one_counts_as_none():
    from heron.entrypoints.openai.serving_common import request_ids

    answer, engine = request_ids("mine", "cmpl")
    assert answer == "mine" and engine.startswith("mine-") and engine != answer
    answer, engine = request_ids("", "cmpl")  # was an answer whose id was ""
    assert answer.startswith("cmpl-") and answer == engine


@pytest.mark.parametrize("args, message", [
    (dict(kv_offloading_size=float("inf")), "kv_offloading_size must be a finite"),  # an OverflowError traceback
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a finite"),  # named no option
    (dict(kv_offloading_dir="/tmp/x", kv_offloading_dir_size=float("inf")), "kv_offloading_dir_size"),
    (dict(kv_offloading_dir=""), "kv_offloading_dir is empty"),  # started with no disk tier and no word
])
def test_kv_tier_options_that_are_no_size_or_place_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", **args).create_engine_config()


def test_a_block_server_that_cannot_listen_names_the_option():
    import torch

    from heron.worker.kv_transfer import KVBlockServer

    with pytest.raises(ValueError, match="kv_ip must be an address of this machine"):
        KVBlockServer([torch.zeros(2, 4, 2, 1, 8)], b"f", "bogus host", 0)


def test_yarn_extends_the_context_to_the_original_times_the_factor():
    """Qwen3's YaRN setting keeps max_position_embeddings 40960 beside factor 4 over
    32768: the model takes 131072 tokens (as vLLM reads it), not 40960."""
    from heron.loader.arch_config import arch_config_from_dict
    from heron.loader.model_config import model_context_length

    values = {"model_type": "qwen3", "max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert model_context_length(arch_config_from_dict(values)) == 131072
    assert model_context_length(arch_config_from_dict({**values, "rope_scaling": None})) == 40960


def test_linear_rope_scaling_stretches_the_context_by_its_factor():
    """As vLLM reads it: a factor-2 model of 4096 positions takes 8192 tokens
    (a --max-model-len past 4096 was refused)."""
    from heron.loader.arch_config import arch_config_from_dict
    from heron.loader.model_config import model_context_length

    values = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 4096}
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert model_context_length(arch_config_from_dict({**values, "rope_parameters": linear})) == 8192
    dynamic = {**linear, "rope_type": "dynamic"}
    assert model_context_length(arch_config_from_dict({**values, "rope_parameters": dynamic})) == 4096


def test_cuda_only_options_are_refused_on_the_cpu(monkeypatch):
    """Each failed later: the triton backend in the engine core with a traceback,
    torch.compile with a Dynamo guard failure on the low-bit path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA only"):
        EngineArgs(device="cpu", attention_backend="triton").create_engine_config()
    with pytest.raises(ValueError, match="compile_model runs on CUDA only"):
        EngineArgs(device="cpu", compile_model=True).create_engine_config()


def test_seed_none_is_a_random_seed_and_one_past_64_bits_is_named():
    """``LLM(seed=None)`` (vLLM's random seed) died in the engine core on
    torch's "manual_seed expected a long, but got NoneType"."""
    seeds = {EngineArgs(device="cpu", seed=None).create_engine_config().model.seed for _ in range(3)}
    assert len(seeds) == 3 and all(isinstance(seed, int) and 0 <= seed < 2**63 for seed in seeds)
    assert EngineArgs(device="cpu", seed=7).create_engine_config().model.seed == 7
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\^63, 2\^64\)"):
        EngineArgs(device="cpu", seed=2**64).create_engine_config()


@pytest.mark.parametrize("name", ["model", "tokenizer", "served_model_name", "profile_dir"])
def test_an_empty_string_is_refused_not_read_as_the_default(name):
    """heron serve --model "$MODEL" with MODEL unset served the embedded model without a word."""
    with pytest.raises(ValueError, match=f"{name} is an empty string"):
        EngineArgs(device="cpu", **{name: ""}).create_engine_config()


def test_the_cli_takes_every_dtype_spelling_llm_takes():
    """--dtype half (vLLM's) was an argparse refusal, though LLM(dtype="half") ran."""
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for spelling, name in (("half", "float16"), ("float", "float32"), ("bf16", "bfloat16"), ("auto", "auto")):
        args = EngineArgs.from_cli_args(parser.parse_args(["--dtype", spelling, "--kv-cache-dtype", spelling]))
        assert (args.dtype, args.kv_cache_dtype) == (name, name)
        assert EngineArgs.from_kwargs("LLM()", dtype=spelling).dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp64"])


def test_kv_events_take_vllms_spellings_of_true_and_false():
    from heron.config import KVEventsConfig

    for value, publishes in (("true", True), (1, True), ("False", False), (0, False), (True, True)):
        assert KVEventsConfig.from_dict({"enable_kv_cache_events": value}).publishes is publishes
