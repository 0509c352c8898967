"""``heron convert``: write any model heron loads (e.g. a GGUF file) as a Hugging
Face directory: config.json, model.safetensors (dequantized) and the tokenizer.
Peers that only read HF checkpoints (vLLM, transformers) can then run the very
same weights."""

from __future__ import annotations

import logging
import os

from safetensors.torch import save_file

from heron.config import EngineConfig
from heron.loader.arch_config import ArchConfig
from heron.loader.tokenizer import load_tokenizer
from heron.loader.weights import iterate_weights

logger = logging.getLogger(__name__)


def export_hf_directory(config: EngineConfig, output_dir: str) -> str:
    model = config.model
    os.makedirs(output_dir, exist_ok=True)
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    tensors = {
        name: tensor.to(model.dtype).contiguous()
        for name, tensor in iterate_weights(model)
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_config = model.hf_config
    if isinstance(hf_config, ArchConfig):
        hf_config = hf_config.to_transformers()
    hf_config.torch_dtype = str(model.dtype).removeprefix("torch.")
    hf_config.save_pretrained(output_dir)
    load_tokenizer(model).save_pretrained(output_dir)
    logger.info("wrote %s (%d tensors, %s)", output_dir, len(tensors), hf_config.torch_dtype)
    return output_dir
