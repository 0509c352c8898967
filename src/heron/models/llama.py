"""The Llama family on flat batches: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 and Qwen3.

The families differ only by flags read from the HF config: Qwen2 adds biases to
the Q/K/V projections, Qwen3 normalizes each head of Q and K (RMSNorm over
head_dim) before RoPE, Mistral may limit attention to a sliding window, and any
of them may tie the LM head to the embedding.

Tokens from all requests of a step are one flat sequence ``[T]`` (no padding);
attention finds each token's request through the step's metadata. Q/K/V and
gate/up projections are fused into single matmuls; the checkpoint's separate
weights are copied into their slices by ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from heron.attention.backend import AttentionLayerSpec, AttentionMetadata
from heron.loader.arch_config import sliding_window_of_layer
from heron.loader.model_config import head_dim_of, model_context_length, rope_parameters
from heron.models.base import CausalLM
from heron.models.layers.attention import Attention
from heron.models.layers.fused import fused_kernels_for
from heron.models.layers.norm import RMSNorm
from heron.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from heron.models.native_decode import NativeLowBitDecoder


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = int(config.hidden_size)
        model_type = getattr(config, "model_type", "llama")
        # as transformers' families read it: Llama and Qwen3 take attention_bias, Mistral never has biases
        # (a stray key refused the checkpoint as lacking weights it never had)
        attention_bias = bool(getattr(config, "attention_bias", False)) and model_type in ("llama", "qwen3")
        # Qwen2 always has Q/K/V biases and never an output-projection bias.
        self.qkv_proj = nn.Linear(
            hidden, self.q_size + 2 * self.kv_size, bias=attention_bias or model_type == "qwen2"
        )
        self.o_proj = nn.Linear(self.q_size, hidden, bias=attention_bias and model_type != "qwen2")
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, float(config.rms_norm_eps))
            self.k_norm = RMSNorm(self.head_dim, float(config.rms_norm_eps))
        self.attn = Attention(
            AttentionLayerSpec(
                layer_idx=layer_idx,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                scale=self.head_dim**-0.5,
                sliding_window=sliding_window_of_layer(config, layer_idx),
            )
        )

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        return self.o_proj(self.attn(self.qkv_proj(hidden), rope, metadata, qk_norm))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, intermediate = int(config.hidden_size), int(config.intermediate_size)
        bias = bool(getattr(config, "mlp_bias", False)) and getattr(config, "model_type", "llama") == "llama"
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the native Llama model")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = fused_kernels_for(gate_up)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(int(config.hidden_size), eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(int(config.hidden_size), eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block over a residual stream kept apart from the block outputs:
        takes the previous block's output and the residual before it (None for the
        first layer, whose input is the embedding) and returns this block's output
        and the residual, so each norm can add the two in the same kernel."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        hidden = int(config.hidden_size)
        self.embed_tokens = nn.Embedding(int(config.vocab_size), hidden)
        self.rotary = RotaryEmbedding(
            head_dim=head_dim_of(config),
            max_position=model_context_length(config),
            rope=rope_parameters(config),
            freq_factors=getattr(config, "heron_rope_freq_factors", None),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer_idx) for layer_idx in range(int(config.num_hidden_layers))
        )
        self.norm = RMSNorm(hidden, float(config.rms_norm_eps))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: nn.Module | None = (
            None if self.tie_word_embeddings else nn.Linear(hidden, int(config.vocab_size), bias=False)
        )
        # set by registry.build_model for low-bit (int4, int8) CPU models: runs decode steps in one C call
        self.native_decoder: NativeLowBitDecoder | None = None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self._decoder_layers()]

    def _decoder_layers(self) -> list[LlamaDecoderLayer]:
        return cast(list[LlamaDecoderLayer], list(self.layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]`` (see CausalLM.forward
        for ``output_rows``: the native path runs the last layer for those rows only)."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, hidden.dtype)
        if self.native_decoder is not None and self.native_decoder.covers(metadata):
            return self.native_decoder(hidden, rope, metadata, output_rows)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, metadata)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def quantize_lm_head(self, make_linear: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        """Quantize the LM head: an untied one, or a copy of the embedding matrix a tied one uses."""
        if self.lm_head is None:
            self.lm_head = make_linear(self.embed_tokens.weight, None)
        elif isinstance(self.lm_head, nn.Linear):  # (a head already quantized stays as it is)
            self.lm_head = make_linear(self.lm_head.weight, self.lm_head.bias)

    # ---- weights -------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters. Every parameter (every
        slice of a fused one) must be written, or loading fails naming what is missing."""
        params = dict(self.named_parameters())
        expected = self._expected_slices()
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            target = self._map_name(name)
            if target is None:
                continue
            param_name, start, length = target
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[param_name]
            destination = param.data if length is None else param.data.narrow(0, start, length)
            if tuple(destination.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add((param_name, start))
        missing = sorted(self._checkpoint_name(name, start) for name, start in expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} of the model's weights ({', '.join(missing[:4])}"
                             f"{', ...' if len(missing) > 4 else ''}): an incomplete download or export?")

    def _checkpoint_name(self, param_name: str, start: int) -> str:
        """The checkpoint's (HF) name of a parameter or of the slice of a fused one
        that starts at row ``start``: the inverse of ``_map_name``, so an error
        names what the checkpoint lacks, not heron's fused layout."""
        attn, intermediate = self._decoder_layers()[0].self_attn, self._decoder_layers()[0].mlp.intermediate
        parts = {"qkv_proj": {0: "q_proj", attn.q_size: "k_proj", attn.q_size + attn.kv_size: "v_proj"},
                 "gate_up_proj": {0: "gate_proj", intermediate: "up_proj"}}
        for fused, slices in parts.items():
            if f".{fused}." in param_name:
                param_name = param_name.replace(fused, slices[start])
        return param_name if param_name.startswith("lm_head.") else f"model.{param_name}"

    def _expected_slices(self) -> set[tuple[str, int]]:
        first = self._decoder_layers()[0]
        attn, intermediate = first.self_attn, first.mlp.intermediate
        expected: set[tuple[str, int]] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                expected.update((name, start) for start in (0, attn.q_size, attn.q_size + attn.kv_size))
            elif ".gate_up_proj." in name:
                expected.update({(name, 0), (name, intermediate)})
            else:
                expected.add((name, 0))
        return expected

    def _map_name(self, name: str) -> tuple[str, int, int | None] | None:
        """HF name -> (our parameter name, row offset, row count or None for all)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied to the embedding
        first = self._decoder_layers()[0]
        attn = first.self_attn
        for proj, start, length in (
            ("q_proj", 0, attn.q_size),
            ("k_proj", attn.q_size, attn.kv_size),
            ("v_proj", attn.q_size + attn.kv_size, attn.kv_size),
        ):
            if f".self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), start, length
        intermediate = first.mlp.intermediate
        for proj, start in (("gate_proj", 0), ("up_proj", intermediate)):
            if f".mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), start, intermediate
        return name, 0, None
