"""Stream a checkpoint's tensors as (Hugging Face parameter name, tensor) pairs.

Tensors are produced one at a time (safetensors files are memory-mapped; GGUF
tensors are dequantized one by one). A GGUF file's dequantized tensors are also
written once to ``~/.cache/heron/weights`` (keyed by the file's path, size and
modification time; ``file_cache.py``), so later starts memory-map them instead
of dequantizing again; set ``HERON_DISABLE_WEIGHT_CACHE=1`` to skip the cache.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch

from heron.config import ModelConfig
from heron.loader.file_cache import entry_path, save_entry

logger = logging.getLogger(__name__)
_CACHE_FORMAT = "1"  # bump when the GGUF -> HF tensor mapping changes


def safetensors_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as index_file:
                weight_map: dict[str, str] = json.load(index_file)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path} is not a readable safetensors index ({type(exc).__name__}: {exc})") \
                from exc
        shards = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        # checked before any is read: a shard missing from a partial download failed only
        # when its turn came, after the others had been read
        missing = [os.path.basename(shard) for shard in shards if not os.path.isfile(shard)]
        if missing:
            raise FileNotFoundError(
                f"{directory}: model.safetensors.index.json lists {len(shards)} weight files, and "
                f"{len(missing)} of them are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "an incomplete download or copy?"
            )
        return shards
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {directory}; heron loads safetensors or GGUF checkpoints"
        )
    return files


def checkpoint_files(model_config: ModelConfig) -> list[str]:
    """The files the model's weights come from: its GGUF file, or its safetensors files."""
    if model_config.source_format == "gguf":
        return [model_config.model]
    return safetensors_files(model_config.model)


def iterate_weights(model_config: ModelConfig, cache_floats: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name. A GGUF file's come dequantized, from the
    cache entry of an earlier start where there is one; ``cache_floats``: write
    that entry (not when another entry will hold what later starts read: a
    low-bit model's packed layers. The float entry of the embedded 98 MB GGUF is
    538 MB, of a 7B model's about 27 GB, and such starts never read it)."""
    if model_config.source_format == "gguf":
        yield from _iterate_gguf_cached(model_config, cache_floats)
        return
    for path in checkpoint_files(model_config):
        yield from _iterate_safetensors(path)


def _iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        checkpoint = safe_open(path, framework="pt")
    except SafetensorError as exc:  # truncated, empty, or not safetensors at all: the traceback named no file
        raise ValueError(f"{path} is not a readable safetensors file ({exc}): an incomplete download or copy?") \
            from exc
    with checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 - safe_open is not a dict
            yield name, checkpoint.get_tensor(name)


def _readable_entry(path: str) -> bool:
    """Whether a cache entry opens; a damaged one (truncated, overwritten) is
    removed, to be built again: it failed every later start."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt"):
            return True
    except (SafetensorError, OSError) as exc:
        logger.warning("ignoring the damaged weight cache entry %s (%s); building it again", path, exc)
        try:
            os.remove(path)
        except OSError:
            pass
        return False


def _iterate_gguf_cached(model_config: ModelConfig, write: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from heron.loader.gguf_file import GGUFFile
    from heron.loader.gguf_model import iterate_gguf_weights

    cache_path = entry_path("float", checkpoint_files(model_config), _CACHE_FORMAT)
    if cache_path is not None and os.path.isfile(cache_path) and _readable_entry(cache_path):
        yield from _iterate_safetensors(cache_path)
        return
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_gguf_weights(GGUFFile(model_config.model), model_config.hf_config):
        if write:
            tensors[name] = tensor
        yield name, tensor
    if cache_path is not None and write:
        save_entry(cache_path, tensors, checkpoint_files(model_config))
