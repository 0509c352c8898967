"""RMSNorm computed in float32, as Hugging Face's Llama does (one fused op; for
float32 inputs it is bitwise equal to HF's pow / mean / rsqrt / mul sequence).
On CUDA it is one Triton kernel, which can also add the residual first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.models.layers.fused import fused_kernels_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_kernels_for(x)
        if kernels is not None and x.dim() == 2:
            return kernels.rms_norm(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual stream of a
        pre-norm block, in one kernel on CUDA."""
        kernels = fused_kernels_for(x)
        if kernels is not None and x.dim() == 2:
            normed, summed = kernels.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return normed, summed
        summed = x + residual
        return self(summed), summed
