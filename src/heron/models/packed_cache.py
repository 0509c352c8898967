"""A low-bit model's packed layers, cached between starts.

The first start of an ``int4`` or ``int8`` model builds it with float weights and
packs every linear layer into its kernel's tiles (``quantization.py``); it then
writes the packed tensors of every low-bit layer and every other parameter to
``~/.cache/heron/weights``. Later starts build the model from that file: no float
weights are loaded into the linear layers and nothing is packed again (on the
embedded model, 0.9 s of a 1.15 s model build on a Zen 3). The file is keyed by
the checkpoint's files (path, size, modification time), the method, the dtype and
the packing code itself (``quantization.py`` and ``quantize_weights.c``), so a
change to any of them builds and writes a new entry (``loader/file_cache.py``
keeps the one before it and removes older ones). ``HERON_DISABLE_WEIGHT_CACHE=1``
skips it, as it skips the cache of dequantized GGUF weights. A file that cannot
be read, or does not fit the model, is rebuilt (a warning says why); the cache
is an optimisation, never a source of truth.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
from torch import nn

from heron.config import ModelConfig
from heron.loader.file_cache import entry_path, save_entry
from heron.loader.weights import checkpoint_files
from heron.models import quantization

logger = logging.getLogger(__name__)

_PACKING_SOURCES = (
    quantization.__file__,
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "kernels", "cpu", "csrc", "quantize_weights.c"),
)
_LAYER_CLASSES: dict[str, type[quantization._Int8InputLinear]] = {
    cls.__name__: cls for cls in (quantization.Int4WeightOnlyLinear, quantization.Int8WeightInt8InputLinear)
}


def packed_cache_path(model_config: ModelConfig) -> str | None:
    """Where this model's packed layers are cached, or None (no cache for it)."""
    if model_config.quantization in (None, "none"):
        return None
    version = f"{model_config.quantization}|{model_config.dtype}"
    for source in _PACKING_SOURCES:
        with open(source, "rb") as handle:
            version += "|" + hashlib.sha256(handle.read()).hexdigest()
    return entry_path(model_config.quantization, checkpoint_files(model_config), version)


def save_packed(model: nn.Module, path: str, model_config: ModelConfig) -> None:
    """Write ``model``'s low-bit layers (their packed tensors) and other parameters
    to the entry ``path``. Models with a layer of another kind
    (``Int8WeightOnlyLinear``) are not cached."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, quantization.Int8WeightOnlyLinear):
            return
        if isinstance(module, quantization._Int8InputLinear) and type(module).__name__ in _LAYER_CLASSES:
            for field in module.PACKED:
                tensors[f"{name}.{field}"] = getattr(module, field)
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias
            layers.append([name, type(module).__name__, module.in_features, module.out_features,
                           module.bias is not None])
    for name, param in model.named_parameters():
        tensors[name] = param.data
    save_entry(path, tensors, checkpoint_files(model_config), {"layers": json.dumps(layers)})


def load_packed(model: nn.Module, path: str) -> bool:
    """Put the cached low-bit layers into ``model`` (built with uninitialized
    float weights) and load its other parameters; False, with a warning, when the
    file cannot be read or does not fit (the caller then builds the slow way)."""
    from safetensors import safe_open

    from heron.kernels.cpu.library import native_library

    native_library()  # a HERON_CPU_ISA this CPU cannot run is the user's error, raised as such, not a damaged file
    try:
        with safe_open(path, framework="pt") as cached:
            layers = json.loads((cached.metadata() or {})["layers"])
            tensors = {name: cached.get_tensor(name) for name in cached.keys()}  # noqa: SIM118 - not a dict
        for name, class_name, in_features, out_features, has_bias in layers:
            cls = _LAYER_CLASSES[class_name]
            layer = cls.from_packed({field: tensors.pop(f"{name}.{field}") for field in cls.PACKED}, in_features,
                                    out_features, tensors.pop(f"{name}.bias") if has_bias else None)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
        params = dict(model.named_parameters())
        if set(params) != set(tensors):
            raise ValueError(f"parameters differ: {sorted(set(params) ^ set(tensors))[:4]}")
        for name, param in params.items():
            if param.shape != tensors[name].shape or param.dtype != tensors[name].dtype:
                raise ValueError(f"{name} is {tuple(tensors[name].shape)} {tensors[name].dtype}, expected "
                                 f"{tuple(param.shape)} {param.dtype}")
            param.data = tensors[name]  # the file's tensor itself: no copy
    except Exception as exc:  # any unreadable or mismatched file: rebuild it
        logger.warning("ignoring the cached packed layers at %s (%s: %s); building them again",
                       path, type(exc).__name__, exc)
        return False
    return True
