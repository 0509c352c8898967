"""The native forward pass of a low-bit Llama on the CPU: one C call runs every
layer of a step (``kernels/cpu/csrc/llama_forward.c``), whatever it holds:
decodes, prefill chunks (with or without a cached prefix), draft tokens.

Both this and the torch path use the same low-bit matrix kernels and compute
the same function; they differ by float32 rounding (attention sums in another
order than torch's), which the int8 rounding of layer inputs now and then turns
into a rounding step (a median logprob difference of about 0.03, at most
about 0.3 on the bundled quality text; greedy continuations can part). It is enabled for
``--quantization int4`` and ``int8`` models whose layers it covers (4-bit or
int8 linears without biases, no Q/K norms, SiLU; a float32 or float16 KV cache);
``HERON_DISABLE_NATIVE_DECODE=1`` turns it off (the name is from when it ran
decode steps only).
"""

from __future__ import annotations

import ctypes
from typing import Any, TypeGuard

import torch

from heron import envs
from heron.attention.backend import AttentionMetadata
from heron.attention.torch_backend import TorchAttentionMetadata
from heron.kernels.cpu.library import native_library
from heron.kernels.cpu.ops import supports_paged_kv_cache
from heron.models.quantization import TILE_COLUMNS, Int4WeightOnlyLinear, Int8WeightInt8InputLinear


class _LowBitWeight(ctypes.Structure):
    _fields_ = [
        ("tiles", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bits", ctypes.c_int64),
    ]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _LowBitWeight),
        ("o", _LowBitWeight),
        ("gate_up", _LowBitWeight),
        ("down", _LowBitWeight),
        ("kv_cache", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
    ]


class _LlamaShape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("kv_half", ctypes.c_int64),
    ]


def _lowbit(linear: Int4WeightOnlyLinear | Int8WeightInt8InputLinear) -> _LowBitWeight:
    if isinstance(linear, Int4WeightOnlyLinear):
        return _LowBitWeight(linear.tiles.data_ptr(), linear.scales.data_ptr(), linear.mins.data_ptr(), 4)
    return _LowBitWeight(linear.tiles.data_ptr(), linear.scales.data_ptr(), None, 8)


class NativeLowBitDecoder:
    """Holds the C view of a low-bit LlamaForCausalLM (weight pointers; the tensors
    stay owned by the model) and runs its steps."""

    def __init__(self, model: Any, library: ctypes.CDLL) -> None:
        self.model = model
        self.function = library.heron_llama_forward_lowbit
        self.function.restype = ctypes.c_int
        self.function.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_DecoderLayer), ctypes.c_int64, ctypes.c_void_p,
            _LlamaShape, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ]
        first = model.layers[0]
        attention = first.self_attn
        self.shape = _LlamaShape(
            hidden=int(model.config.hidden_size),
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            intermediate=first.mlp.intermediate,
            eps=first.input_layernorm.eps,
            scale=attention.attn.spec.scale,
        )
        self.layers = (_DecoderLayer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers):
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv = _lowbit(layer.self_attn.qkv_proj)
            entry.o = _lowbit(layer.self_attn.o_proj)
            entry.gate_up = _lowbit(layer.mlp.gate_up_proj)
            entry.down = _lowbit(layer.mlp.down_proj)
            entry.sliding_window = layer.self_attn.attn.spec.sliding_window or 0
        self._bound_caches: list[int] = []

    @staticmethod
    def build(model: Any, kv_cache_dtype: torch.dtype | None = None) -> NativeLowBitDecoder | None:
        """The decoder for ``model`` (its KV cache holding ``kv_cache_dtype``, None:
        the model's dtype), or None where the native path does not cover it
        (``unsupported_reason`` says why)."""
        if NativeLowBitDecoder.unsupported_reason(model, kv_cache_dtype) is not None:
            return None
        library = native_library()
        assert library is not None
        return NativeLowBitDecoder(model, library)

    @staticmethod
    def unsupported_reason(model: Any, kv_cache_dtype: torch.dtype | None = None) -> str | None:
        """Why the native path cannot run ``model``'s steps, or None when it can."""
        if envs.is_set(envs.HERON_DISABLE_NATIVE_DECODE):
            return "HERON_DISABLE_NATIVE_DECODE is set"
        if native_library() is None:
            return "no native CPU kernels (no C compiler, or HERON_DISABLE_NATIVE)"
        if not hasattr(model, "layers"):
            return "not a native Llama-family model"
        # float32 throughout: the embeddings (hence the KV cache's dtype) and every norm
        norms = [model.norm.weight] + [
            weight for layer in model.layers
            for weight in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        ]
        if model.embed_tokens.weight.dtype != torch.float32 or any(w.dtype != torch.float32 for w in norms):
            return "the model is not float32"
        if kv_cache_dtype is not None and not supports_paged_kv_cache(kv_cache_dtype):
            # the kernels read float32 or float16 K/V: built anyway, its first step raised and the engine died
            return f"a {str(kv_cache_dtype).removeprefix('torch.')} KV cache (the native path reads float32 or float16)"
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(
                isinstance(linear, (Int4WeightOnlyLinear, Int8WeightInt8InputLinear))
                and linear.uses_native_kernel
                and linear.bias is None
                and linear.out_features % TILE_COLUMNS == 0
                for linear in linears
            ):
                return "a linear layer has a bias, an odd width or no native kernel"
            if attention.qk_norm or attention.attn.spec.logits_soft_cap is not None:
                return "Q/K norms or logit soft-capping"
            if attention.head_dim > 512 or attention.num_heads > 256:  # the kernels' per-task limits
                return "heads wider than 512 or more than 256 query heads"
        return None

    def covers(self, metadata: AttentionMetadata) -> TypeGuard[TorchAttentionMetadata]:
        """Whether this step can run natively: any step of the CPU's attention
        backend (the model's layers were checked when the decoder was built)."""
        return isinstance(metadata, TorchAttentionMetadata) and metadata.num_tokens > 0

    def _bind_caches(self) -> None:
        caches = [layer.self_attn.attn.kv_cache for layer in self.model.layers]
        pointers = [cache.data_ptr() for cache in caches]
        if pointers != self._bound_caches:
            for entry, cache in zip(self.layers, caches):
                if not supports_paged_kv_cache(cache.dtype) or not cache.is_contiguous():
                    raise ValueError("the native forward pass needs a contiguous float32 or float16 KV cache")
                entry.kv_cache = cache.data_ptr()
            self.shape.kv_half = int(caches[0].dtype == torch.float16)
            self._bound_caches = pointers

    def __call__(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: TorchAttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: the embeddings ``[B, hidden]`` float32; returns the final-normed
        hidden states (the same tensor, updated in place). With ``output_rows``
        (int64, strictly increasing) only those rows are final: the last layer's
        attention and MLP run for them alone, the other rows' values are left
        unspecified. Only for steps it ``covers``."""
        self._bind_caches()
        hidden = hidden.contiguous()
        cos, signed_sin = (table.reshape(hidden.shape[0], -1).contiguous() for table in rope)
        block_table, table_rows, context_lens = metadata.token_rows()
        slots = metadata.slot_mapping.contiguous()
        kv_cache = self.model.layers[0].self_attn.attn.kv_cache
        status = self.function(
            hidden.data_ptr(), hidden.shape[0], self.layers, len(self.layers), self.model.norm.weight.data_ptr(),
            self.shape, cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], None if table_rows is None else table_rows.data_ptr(), context_lens.data_ptr(),
            kv_cache.shape[2], kv_cache.shape[1],
            None if output_rows is None else output_rows.data_ptr(), 0 if output_rows is None else len(output_rows),
        )
        if status != 0:
            raise RuntimeError(f"native forward pass failed (status {status})")
        return hidden
