"""When the model calls heron's fused Triton kernels (``triton_ops``) instead of
torch ops: on CUDA tensors, with Triton installed, and not while torch.compile
traces the model (inductor fuses the torch ops itself). The kernels' module is
imported on first use, so a CPU process never pays for importing Triton."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def fused_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """``heron.models.layers.triton_ops`` if ``x`` should go through it, else None."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return None
    return triton_kernels()


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The fused kernels' module, or None without Triton."""
    try:
        from heron.models.layers import triton_ops
    except ImportError:
        return None
    return triton_ops
