"""Which implementation runs a model, and building it with its weights loaded.

Native implementations (flat batches, fused projections) exist for the Llama
family; any other causal LM that transformers implements runs through
transformers' own modeling code with heron's paged attention plugged in
(``hf_fallback``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from heron.config import ModelConfig
from heron.models.base import CausalLM
from heron.models.implementation import NATIVE_ARCHITECTURES, native_architecture, select_implementation
from heron.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def _skip_weight_init() -> Iterator[None]:
    """Construct linear and embedding layers without their random initialization
    (a meta-device build would do the same, but costs 1.5 s of torch imports)."""
    saved = (nn.Linear.reset_parameters, nn.Embedding.reset_parameters)
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def build_model(model_config: ModelConfig, device: torch.device, kv_cache_dtype: torch.dtype | None = None,
                ) -> CausalLM:
    """Instantiate the model on ``device`` in ``model_config.dtype`` with its weights;
    its KV cache will hold ``kv_cache_dtype`` (None: the model's dtype)."""
    from heron.models.quantization import quantize_model

    if select_implementation(model_config) == "transformers":
        from heron.models.hf_fallback import TransformersCausalLM

        logger.info("running %s through transformers' modeling code", model_config.architecture)
        return quantize_model(TransformersCausalLM(model_config, device), model_config.quantization, device)
    from heron.loader.weights import iterate_weights
    from heron.models.packed_cache import load_packed, packed_cache_path, save_packed

    cache_path = packed_cache_path(model_config) if device.type == "cpu" else None
    model = _instantiate(model_config, device)
    if cache_path is not None and os.path.isfile(cache_path):
        if load_packed(model, cache_path):
            logger.info("low-bit layers loaded from %s", cache_path)
            return _with_native_decoder(model.eval(), model_config.quantization, kv_cache_dtype)
        model = _instantiate(model_config, device)  # a fresh one: loading may have replaced some layers
    try:
        model.load_weights(
            # the packed entry is what later starts read: no float entry beside it
            (name, tensor.to(model_config.dtype)) for name, tensor in iterate_weights(model_config, cache_path is None)
        )
    except ValueError as exc:  # say which checkpoint (a Hub id names a snapshot directory)
        raise ValueError(f"{model_config.model}: {exc}") from exc
    model = quantize_model(model.eval(), model_config.quantization, device)
    if cache_path is not None:
        save_packed(model, cache_path, model_config)
    return _with_native_decoder(model, model_config.quantization, kv_cache_dtype)


def _instantiate(model_config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
    """The native model on ``device`` in its dtype, its weights not yet loaded
    (uninitialized memory), its buffers (rotary tables) built."""
    architecture = native_architecture(model_config)
    assert architecture is not None  # select_implementation chose "native"
    module_name, class_name = NATIVE_ARCHITECTURES[architecture]
    model_class: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), class_name)
    with _skip_weight_init():  # every weight is overwritten by the checkpoint
        model = model_class(model_config.hf_config)
    model = model.to(device=device, dtype=model_config.dtype)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
    return model


def _with_native_decoder(model: LlamaForCausalLM, method: str, kv_cache_dtype: torch.dtype | None,
                         ) -> LlamaForCausalLM:
    if method != "none" and isinstance(model, LlamaForCausalLM):
        _attach_native_decoder(model, method, kv_cache_dtype)
    return model


def _attach_native_decoder(model: LlamaForCausalLM, method: str, kv_cache_dtype: torch.dtype | None) -> None:
    """Run a low-bit native model's decode steps in one C call where the native
    path covers it; say so (never silently) where it does not: the step is then
    several times slower."""
    from heron.models.native_decode import NativeLowBitDecoder

    model.native_decoder = NativeLowBitDecoder.build(model, kv_cache_dtype)
    if model.native_decoder is None:
        logger.warning("%s decode steps take the torch path: %s", method,
                       NativeLowBitDecoder.unsupported_reason(model, kv_cache_dtype))
