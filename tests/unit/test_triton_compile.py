"""heron's Triton kernels compile for a Hopper GPU (sm_90) on a machine without
one: Triton lowers them to PTX and assembles a cubin with its bundled ptxas.
The interpreter (test_triton_kernels.py) checks what they compute; this checks
what only a real compile sees (constructs the compiler rejects). It runs in a
subprocess because the test process runs Triton in interpreter mode, where
kernels cannot be compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

INDEX_POINTERS = {"slot_ptr": "i64", "block_table_ptr": "i32", "seq_lens_ptr": "i32",
                  "query_start_loc_ptr": "i32", "work_seq_ptr": "i32", "work_q_ptr": "i32",
                  "partial_out_ptr": "fp32", "partial_lse_ptr": "fp32"}
FLOAT_SCALARS = {"eps", "inv_hidden", "scale", "softcap"}


def compile_for_hopper(kernel, dtype: str, num_warps: int, **constexprs) -> None:
    """Compile ``kernel`` down to a cubin, every pointer of ``dtype`` (index
    pointers of their integer type)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + INDEX_POINTERS.get(name, dtype)
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), (kernel.__name__, dtype, constexprs)


def main() -> None:
    from heron.attention import triton_backend
    from heron.models.layers import triton_ops

    for dtype in ("bf16", "fp32"):  # (fp16 compiles as bf16 does)
        for hidden in (576, 2048, 8192):
            block = 1 << (hidden - 1).bit_length()
            for has_residual in (False, True):
                compile_for_hopper(triton_ops._rms_norm_kernel, dtype, triton_ops._warps_for(block),
                                   HAS_RESIDUAL=has_residual, BLOCK=block)
        for heads, kv_heads, head_dim, qk_norm in ((32, 8, 64, False), (40, 8, 128, True), (9, 3, 80, False)):
            compile_for_hopper(triton_ops._rotate_and_store_kernel, dtype, 1, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads,
                               HEAD_DIM=head_dim, HALF_PADDED=1 << (head_dim // 2 - 1).bit_length(),
                               HAS_QK_NORM=qk_norm)
        compile_for_hopper(triton_ops._silu_and_mul_kernel, dtype, triton_ops._warps_for(1024), BLOCK=1024)
        # (group, head dim, query tokens per program, splits, window): prefill tiles, and
        # decode tiles (16 // group tokens) with and without split-KV
        for group, head_dim, block_q, splits, window in (
            (4, 64, 4, 1, True), (4, 128, 16, 1, True), (1, 64, 64, 1, True),
            (4, 64, 4, 16, True), (4, 64, 4, 16, False), (1, 128, 16, 2, False), (8, 128, 2, 8, False),
        ):
            compile_for_hopper(
                triton_backend._paged_attention_kernel, dtype, 4, GROUP=group, BLOCK_SIZE=16, HEAD_DIM=head_dim,
                HEAD_DIM_PADDED=head_dim, BLOCK_Q=block_q, BLOCK_M=max(16, block_q * group), TILE_N=64,
                USE_SOFTCAP=False, USE_WINDOW=window, IEEE=dtype == "fp32", NUM_SPLITS=splits,
            )
        for splits, head_dim in ((2, 64), (16, 128), (16, 80)):
            compile_for_hopper(triton_backend._merge_kv_splits_kernel, dtype, 1, NUM_SPLITS=splits,
                               HEAD_DIM=head_dim, HEAD_DIM_PADDED=1 << (head_dim - 1).bit_length())
    print("compiled")


def test_kernels_compile_for_hopper(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile afresh, and write nothing under $HOME
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's bundled ptxas is missing")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


if __name__ == "__main__":
    main()
