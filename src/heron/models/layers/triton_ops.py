"""Fused GPU kernels for the Llama layer's small operations (Triton).

A decode step at small batch sizes is dominated by kernel count, not by work:
in eager torch one layer launches ~30 kernels (RMSNorm alone is eight: upcast,
square, mean, add, rsqrt, multiply, downcast, scale), and inside a CUDA graph
each still costs a few microseconds of GPU time. These kernels replace them
with three per layer:

- ``rms_norm``: optionally adds the residual first (returning the sum as the
  new residual), then normalizes: one kernel per norm instead of ~9;
- ``rotate_and_store``: takes the fused Q/K/V projection, optionally RMS-
  normalizes each Q/K head (Qwen3), rotates Q and K (RoPE), writes K and V into
  their paged cache slots and Q into a contiguous tensor: one kernel instead of
  ~10 (slicing copies, rotary, two cache writes);
- ``silu_and_mul``: SiLU(gate) * up from the fused gate/up projection.

Each kernel rounds to the activation dtype where the torch code it replaces
rounds (a bf16 ``x + residual`` before the norm reads it, the normalized row
before the weight multiplies it, ``x * cos`` before the rotated half is added,
``silu(gate)`` before ``up`` multiplies it), and divides as IEEE does, so
float16/bfloat16 results match the torch path but for rare one-ulp flips, and
float32 ones within a few ulps: reduction order, fused multiply-adds and the
GPU's approximate ``rsqrt``/``exp`` (torch's CUDA ``rsqrt`` is approximate too).
The wrappers run wherever Triton can: on CUDA devices, and on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests check them).
``fused.py`` decides when the model calls them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, inv_hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=valid, other=0.0)
        # rounded to the activation dtype, as torch's `x + residual` is
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=valid)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) * inv_hidden  # a mean as torch takes it: sum * (1 / n)
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rotate_and_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    stride_qkv, stride_cos, stride_sin, stride_qo_t, stride_qo_h,
    stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_PADDED: tl.constexpr, HAS_QK_NORM: tl.constexpr,
):
    # one program per (token, head) with heads numbered Q heads first, then K heads;
    # a K head's program also copies the matching V head
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    dims = tl.arange(0, HALF_PADDED)
    valid = dims < half
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    x1 = tl.load(row + dims, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + dims, mask=valid, other=0.0).to(tl.float32)
    if HAS_QK_NORM:  # RMSNorm over the head (Qwen3), rounded as the torch module rounds
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * (1.0 / HEAD_DIM) + eps)
        if head < NUM_HEADS:
            w1 = tl.load(q_norm_ptr + dims, mask=valid, other=0.0).to(tl.float32)
            w2 = tl.load(q_norm_ptr + half + dims, mask=valid, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(k_norm_ptr + dims, mask=valid, other=0.0).to(tl.float32)
            w2 = tl.load(k_norm_ptr + half + dims, mask=valid, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with the sign of rotate_half folded into sin
    cos1 = tl.load(cos_ptr + token * stride_cos + dims, mask=valid, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + half + dims, mask=valid, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_sin + dims, mask=valid, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_sin + half + dims, mask=valid, other=0.0).to(tl.float32)
    out1 = ((x1 * cos1).to(dtype).to(tl.float32) + x2 * sin1).to(dtype)
    out2 = ((x2 * cos2).to(dtype).to(tl.float32) + x1 * sin2).to(dtype)
    if head < NUM_HEADS:
        q_out = q_out_ptr + token * stride_qo_t + head * stride_qo_h
        tl.store(q_out + dims, out1, mask=valid)
        tl.store(q_out + half + dims, out2, mask=valid)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_ptr + token).to(tl.int64)
        k_out = k_cache_ptr + slot * stride_kc_slot + kv_head * stride_kc_h
        tl.store(k_out + dims, out1.to(k_cache_ptr.dtype.element_ty), mask=valid)
        tl.store(k_out + half + dims, out2.to(k_cache_ptr.dtype.element_ty), mask=valid)
        v_row = row + NUM_KV_HEADS * HEAD_DIM  # this K head's V head
        v_out = v_cache_ptr + slot * stride_vc_slot + kv_head * stride_vc_h
        v1 = tl.load(v_row + dims, mask=valid, other=0.0)
        v2 = tl.load(v_row + half + dims, mask=valid, other=0.0)
        tl.store(v_out + dims, v1.to(v_cache_ptr.dtype.element_ty), mask=valid)
        tl.store(v_out + half + dims, v2.to(v_cache_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=valid, other=0.0).to(tl.float32)
    activated = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=valid)


def _warps_for(block: int) -> int:
    return min(16, max(1, block // 256))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of the rows of ``x`` (``[T, hidden]``); with ``residual``, of
    ``x + residual``, which is also returned (the next layer's residual)."""
    hidden = x.shape[-1]
    x = x.reshape(-1, hidden)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None
    if residual is not None:
        residual = residual.reshape(-1, hidden)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        residual_out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual if residual is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        hidden, 1.0 / hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps_for(block),
    )
    return out, residual_out


def rotate_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """From the fused projection ``qkv`` (``[T, (H + 2 Hkv) * D]``): rotated
    queries ``[T, H, D]``; rotated keys and the values are written into their
    slots of ``kv_cache`` (``[2, blocks, block_size, Hkv, D]``). ``cos`` and
    ``signed_sin`` are the step's rotary tables (``[T, 1, D]`` or ``[T, D]``);
    ``qk_norm`` = (q_norm weight, k_norm weight, eps) normalizes each head first."""
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [slots, Hkv, D]
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    cos = cos.reshape(num_tokens, head_dim)
    signed_sin = signed_sin.reshape(num_tokens, head_dim)
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    if num_tokens:
        _rotate_and_store_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, cos, signed_sin, query, key_cache, value_cache, slot_mapping,
            q_norm, k_norm, eps,
            qkv.stride(0), cos.stride(0), signed_sin.stride(0), query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_PADDED=triton.next_power_of_2(head_dim // 2), HAS_QK_NORM=qk_norm is not None,
            num_warps=1,
        )
    return query


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` (``[T, 2 I]`` -> ``[T, I]``)."""
    width = gate_up.shape[-1] // 2
    gate_up = gate_up.reshape(-1, 2 * width)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((gate_up.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if gate_up.shape[0]:
        _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block, num_warps=_warps_for(block)
        )
    return out
