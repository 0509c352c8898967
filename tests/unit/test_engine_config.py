"""Defaults that depend on the device and the use (EngineConfig.create)."""

from __future__ import annotations

import pytest

from heron.config import EngineConfig


def test_cpu_defaults_for_offline_use_and_serving():
    offline = EngineConfig.create(device="cpu")
    assert offline.scheduler.max_num_seqs == 64 and offline.scheduler.max_num_batched_tokens == 2048
    serving = EngineConfig.create(device="cpu", usage="serve")
    assert serving.scheduler.max_num_batched_tokens == 512  # bounds a decode's wait behind a prompt
    wide = EngineConfig.create(device="cpu", usage="serve", max_num_seqs=600)
    assert wide.scheduler.max_num_seqs == 600 and wide.scheduler.max_num_batched_tokens == 600
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.create(device="cpu", max_num_seqs=0)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_default_is_the_low_bit_fast_path_on_every_cpu(monkeypatch, native_bf16):
    """The embedded Q4_1 GGUF runs in int4 on float32 activations whether or not
    the CPU has native bf16 (on one that has, "auto" once gave bf16 and the native
    decode path switched itself off); unquantized, "auto" follows the CPU."""
    import torch

    from heron import config as config_module
    from heron.kernels.cpu import isa

    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar", "avx2"])  # what the CPU is does not matter here
    default = EngineConfig.create(device="cpu")
    assert (default.model.quantization, default.model.dtype) == ("int4", torch.float32)
    plain = EngineConfig.create(device="cpu", quantization="none")
    assert plain.model.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    explicit = EngineConfig.create(device="cpu", dtype="bfloat16")
    assert (explicit.model.quantization, explicit.model.dtype) == ("none", torch.bfloat16)


def test_auto_quantization_needs_vectorized_kernels(monkeypatch):
    """Without AVX2 the low-bit kernels would run their portable reference (20-90x
    slower than AVX2's): "auto" keeps such a CPU unquantized."""
    from heron.kernels.cpu import isa

    monkeypatch.setattr(isa, "supported_isas", lambda: ["scalar"])
    assert EngineConfig.create(device="cpu").model.quantization == "none"
