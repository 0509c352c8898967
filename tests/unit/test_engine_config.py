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
