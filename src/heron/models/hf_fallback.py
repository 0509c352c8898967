"""Run any transformers causal LM on heron's flat batch and paged KV cache.

The model's own code does everything but attention: heron registers an attention
function with transformers' ``AttentionInterface`` that writes K/V into heron's
paged cache and attends with the step's backend, and a mask function that builds
no mask (the backend knows each token's request and position). The flat batch is
fed as a batch of one sequence with the real per-token positions, and the step's
metadata travels to the attention function through the forward kwargs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from heron.attention.backend import AttentionLayerSpec, AttentionMetadata
from heron.config import ModelConfig
from heron.loader.model_config import head_dim_of
from heron.models.base import CausalLM
from heron.models.layers.attention import Attention

ATTENTION_NAME = "heron_paged"
# layer kinds whose only state between tokens is K/V (transformers' ``layer_types``)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def check_fallback_support(hf_config: Any) -> None:
    """A ValueError naming what heron's paged attention cannot run in a model
    transformers implements (each ran, and answered wrong or failed at its
    first step): state between tokens other than K/V (Mamba and other
    recurrent or hybrid layers: a flat batch feeds only a step's new tokens),
    an attention that takes no plugged-in function, value heads of another size
    than query and key heads (DeepSeek's MLA)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", "")
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    text_config = _text_config(hf_config)
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    if "chunked_attention" in layer_types:  # transformers applies the chunks through the mask heron does not build
        raise ValueError(f"{model_type!r} models attend within chunks of the sequence on some layers (chunked "
                         "attention, as Llama 4's), which heron's paged attention does not: not supported")
    if getattr(text_config, "attn_temperature_tuning", False) and 0 in (getattr(text_config, "no_rope_layers", None)
                                                                      or ()):
        # transformers counts the positions 0..T-1 of its call, heron's call being a whole step's flat batch
        raise ValueError(f"{model_type!r} models scale the attention of their layers without RoPE by each token's "
                         "position, counted over a forward call, which in heron holds many requests: not supported")
    others = sorted({kind for kind in layer_types if kind not in ATTENTION_LAYER_TYPES})
    if getattr(model_class, "_is_stateful", False) or others:
        kinds = f" ({', '.join(map(str, others))} layers)" if others else ""
        raise ValueError(f"{model_type!r} models keep a state between tokens besides attention's K/V{kinds}, "
                         "which heron's paged KV cache does not hold: not supported")
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(f"{model_type!r} models take no attention function from outside (transformers' "
                         "AttentionInterface), where heron plugs in its paged attention: not supported")
    head = head_dim_of(text_config)
    nope, rope = getattr(text_config, "qk_nope_head_dim", None), getattr(text_config, "qk_rope_head_dim", None)
    query_head = int(nope) + int(rope) if nope is not None and rope is not None else head
    value_head = int(getattr(text_config, "v_head_dim", None) or query_head)
    if not query_head == value_head == head:
        raise ValueError(f"{model_type!r} models have query/key heads of {query_head} dimensions and value heads "
                         f"of {value_head}, where heron's KV cache would hold heads of {head} (multi-head latent "
                         "attention): not supported")


def _text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal one nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_multiplier(text_config: Any) -> float:
    """The scale a model's own head applies to its logits, by family (the same
    key means opposite things): Cohere multiplies by ``logit_scale``, Granite
    divides by ``logits_scaling``, HyperCLOVA X multiplies by it."""
    model_type = str(getattr(text_config, "model_type", ""))
    multiplier = float(getattr(text_config, "logit_scale", None) or 1.0) if model_type.startswith("cohere") else 1.0
    scaling = float(getattr(text_config, "logits_scaling", None) or 1.0)
    if model_type.startswith("granite"):
        multiplier /= scaling
    elif model_type.startswith("hyperclovax"):
        multiplier *= scaling
    return multiplier


def _register_with_transformers() -> None:
    """Idempotent: transformers' registries are process-wide."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _window_of_mask)


@dataclass(frozen=True, slots=True)
class MaskWindow:
    """What heron takes of the mask a model asks for: its sliding window (None:
    plain causal). It reaches the attention function as ``attention_mask``:
    some models (Qwen2-MoE, PhiMoE) give their window to the mask alone."""

    sliding_window: int | None


def _window_of_mask(*args: Any, local_size: int | None = None, **kwargs: Any) -> MaskWindow:
    """The mask a model asks for, reduced to its sliding window: transformers'
    sliding-window mask gives it as ``local_size`` (chunked attention does too,
    refused at load). heron's attention builds the mask itself from each
    token's request and position."""
    return MaskWindow(int(local_size) if local_size else None)


def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D], rotary already applied
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    layer_idx: int = module.layer_idx  # type: ignore[assignment]  # set by transformers on its attention modules
    shapes = kwargs.get("heron_attention_shapes")
    if shapes is not None:  # the load's probe (TransformersCausalLM._attention_shapes): no cache yet
        shapes[layer_idx] = (query.shape[1], key.shape[1], key.shape[-1])
        return query.transpose(1, 2), None
    layers: list[Attention] = kwargs["heron_layers"]
    layer = layers[layer_idx]
    spec = layer.spec
    # the window a model passes, else the one its mask asked for
    window_of_mask = attention_mask.sliding_window if isinstance(attention_mask, MaskWindow) else None
    sliding_window = kwargs.get("sliding_window") or window_of_mask
    softcap = kwargs.get("softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (spec.scale, spec.sliding_window, spec.logits_soft_cap) != (scale, sliding_window, softcap):
        spec = replace(spec, scale=scale, sliding_window=sliding_window, logits_soft_cap=softcap)
        layer.spec = spec
    assert layer.backend is not None and layer.kv_cache is not None, "KV cache not bound"
    output = layer.backend.forward(
        spec,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        layer.kv_cache,
        kwargs["heron_metadata"],
    )
    return output.unsqueeze(0), None  # [1, T, H, D]


# what a LongRoPE rotary module's type becomes once its factors are fixed (transformers then leaves them be)
FIXED_LONGROPE = "longrope (factors fixed by heron)"


def fix_longrope_factors(hf_model: nn.Module, max_model_len: int) -> None:
    """Give every LongRoPE rotary module (Phi-3's, or any ``longrope`` config)
    one set of factors for good: the long ones when ``max_model_len`` exceeds
    the original context, else the short ones, as vLLM does.

    transformers picks them per forward call by the call's largest position.
    heron's call is a whole step's flat batch, so a request's factors depended
    on what it was batched with, on how its prefill was chunked and on when its
    cached prefix was computed, and K/V written under one set were read under
    the other. With the factors fixed, a short prompt under a long
    ``max_model_len`` is rotated with the long factors where transformers
    alone would use the short ones."""
    for module in hf_model.modules():
        rope_type = getattr(module, "rope_type", None)
        if not isinstance(rope_type, (str, dict)):
            continue
        kinds = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        # a rotary module of one RoPE per layer type (Gemma 3's) keeps "<layer type>_original_inv_freq"
        longrope = [layer_type for layer_type, kind in kinds.items() if kind == "longrope"
                    and hasattr(module, f"{layer_type}_original_inv_freq" if layer_type else "original_inv_freq")]
        if not longrope:
            continue
        device = next(module.buffers()).device
        probe = torch.zeros(1, device=device)
        last_position = torch.tensor([[max_model_len - 1]], device=device)
        with torch.no_grad():
            for layer_type in longrope:  # transformers' own choice, made once for the longest sequence
                module(probe, last_position, **({"layer_type": layer_type} if layer_type is not None else {}))
        fixed = {layer_type: FIXED_LONGROPE if layer_type in longrope else kind for layer_type, kind in kinds.items()}
        setattr(module, "rope_type", fixed if isinstance(rope_type, dict) else FIXED_LONGROPE)  # noqa: B010


def _decoder_of(hf_model: nn.Module) -> nn.Module:
    """The model without its head: the submodule ``base_model_prefix`` names, or
    ``model`` where that names none (Llama 4's and Mllama's causal LMs name
    "language_model": a load that passed failed at its first step)."""
    prefix = str(getattr(hf_model, "base_model_prefix", ""))
    decoder = getattr(hf_model, prefix, None) if prefix else None
    decoder = decoder if isinstance(decoder, nn.Module) else getattr(hf_model, "model", None)
    if not isinstance(decoder, nn.Module):
        raise ValueError(f"{type(hf_model).__name__} has no decoder module heron can find "
                         f"(neither {prefix!r} nor 'model'): not supported")
    return decoder


class TransformersCausalLM(CausalLM):
    def __init__(self, model_config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        check_fallback_support(model_config.hf_config)
        _register_with_transformers()
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            model_config.model, dtype=model_config.dtype, attn_implementation=ATTENTION_NAME,
            output_loading_info=True,
        )
        hf_model, loading = loaded
        # transformers fills a missing weight with random values and only prints a report: the model ran,
        # and answered garbage (a native family refuses such a checkpoint)
        missing = sorted(loading.get("missing_keys") or [])
        if missing:
            raise ValueError(f"{model_config.model}: the checkpoint lacks {len(missing)} of the model's weights "
                             f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): an incomplete "
                             "download or export?")
        if any(name.endswith("sinks") for name, _ in hf_model.named_parameters()):
            raise ValueError(f"{model_config.model}: the model's attention has learned sinks (gpt-oss), which "
                             "heron's attention does not add: not supported")
        self.hf_model = hf_model.to(device).eval()
        self.decoder = _decoder_of(self.hf_model)
        fix_longrope_factors(self.hf_model, model_config.max_model_len)
        config = self.hf_model.config
        text_config = _text_config(config)
        num_heads = int(text_config.num_attention_heads)
        head_dim = head_dim_of(text_config)
        num_kv_heads = int(getattr(text_config, "num_key_value_heads", None) or num_heads)
        shapes = self._attention_shapes(device)
        self.layers = []
        for index in range(int(text_config.num_hidden_layers)):
            heads, kv_heads, size = shapes.get(index, (num_heads, num_kv_heads, head_dim))
            self.layers.append(Attention(AttentionLayerSpec(
                layer_idx=index, num_heads=heads, num_kv_heads=kv_heads, head_dim=size, scale=size**-0.5)))
        self.final_logit_softcapping = getattr(text_config, "final_logit_softcapping", None)
        self.logit_multiplier = logit_multiplier(text_config)

    def _attention_shapes(self, device: torch.device) -> dict[int, tuple[int, int, int]]:
        """Query heads, KV heads and head size of each attention layer, as the
        model's own code makes them for one token. A config's keys may say
        otherwise (a GPT-NeoX config's stray num_key_value_heads, which its
        attention ignores): the KV cache was sized by them, and the first step
        failed on the shapes."""
        shapes: dict[int, tuple[int, int, int]] = {}
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        with torch.inference_mode():
            self.decoder(input_ids=token, position_ids=token, use_cache=False, heron_attention_shapes=shapes)
        return shapes

    def attention_layers(self) -> list[Attention]:
        return self.layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        outputs = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            heron_metadata=metadata,
            heron_layers=self.layers,
        )
        return outputs.last_hidden_state[0]

    def quantize_lm_head(self, make_linear: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
        """Quantize the model's output embeddings (tied or not: a copy of the matrix)."""
        head = self.hf_model.get_output_embeddings()
        if isinstance(head, nn.Linear):
            self.hf_model.set_output_embeddings(make_linear(head.weight, head.bias))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden).float()
        if self.logit_multiplier != 1.0:
            logits = logits * self.logit_multiplier
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits
