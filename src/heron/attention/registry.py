"""Attention backends by name, imported only when chosen (Triton costs start-up
time and exists only where CUDA does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heron.attention.backend import AttentionBackend
from heron.config import AttentionBackendName, check_choice


def _torch_backend(num_heads: int, num_kv_heads: int) -> AttentionBackend[Any]:
    from heron.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_backend(num_heads: int, num_kv_heads: int) -> AttentionBackend[Any]:
    from heron.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(num_heads // num_kv_heads)


# name -> factory(num_heads, num_kv_heads)
ATTENTION_BACKENDS: dict[str, Callable[[int, int], AttentionBackend[Any]]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def default_backend_name(device: torch.device) -> str:
    """"triton" on CUDA when Triton is installed, otherwise "torch" (plain torch
    ops, any device)."""
    if device.type == "cuda":
        from heron.attention.triton_backend import triton_available

        if triton_available():
            return "triton"
    return "torch"


def get_attention_backend(
    device: torch.device, num_heads: int, num_kv_heads: int, name: AttentionBackendName | None = None
) -> AttentionBackend[Any]:
    """The backend called ``name`` ("auto" or None: the device's default)."""
    check_choice("attention backend", name or "auto", AttentionBackendName)
    chosen = default_backend_name(device) if name in (None, "auto") else name
    return ATTENTION_BACKENDS[chosen](num_heads, num_kv_heads)
