"""Stream a checkpoint's tensors as (Hugging Face parameter name, tensor) pairs.

Tensors are produced one at a time (safetensors files are memory-mapped; GGUF
tensors are dequantized one by one), so peak memory stays near the size of the
model plus one tensor.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from heron.config import ModelConfig


def safetensors_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as index_file:
            weight_map: dict[str, str] = json.load(index_file)["weight_map"]
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {directory}; heron loads safetensors or GGUF checkpoints"
        )
    return files


def iterate_weights(model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if model_config.source_format == "gguf":
        from heron.loader.gguf_file import GGUFFile
        from heron.loader.gguf_model import iterate_gguf_weights

        yield from iterate_gguf_weights(GGUFFile(model_config.model), model_config.hf_config)
        return
    from safetensors import safe_open

    for path in safetensors_files(model_config.model):
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():
                yield name, checkpoint.get_tensor(name)
