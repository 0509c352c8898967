"""``heron convert``: write any model heron loads (e.g. a GGUF file) as a Hugging
Face directory: config.json, model.safetensors (dequantized) and the tokenizer.
Peers that only read HF checkpoints (vLLM, transformers) can then run the very
same weights."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import torch
from safetensors.torch import save_file

from heron.config import EngineConfig
from heron.loader.arch_config import ArchConfig
from heron.loader.tokenizer import load_tokenizer
from heron.loader.weights import iterate_weights
from heron.models.layers.rotary import compute_inv_freq

logger = logging.getLogger(__name__)


def export_hf_directory(config: EngineConfig, output_dir: str) -> str:
    """Write ``config``'s model into ``output_dir``, a new or empty directory:
    written into a checkpoint's directory, its old shards and index stayed
    beside the new file, and the index won (heron and transformers then loaded
    different weights from one directory)."""
    model = config.model
    prepare_output_directory(output_dir)
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    tensors = {
        name: tensor.to(model.dtype).contiguous()
        for name, tensor in iterate_weights(model, cache_floats=False)  # the directory written is the copy
        if not (tied and name == "lm_head.weight")
    }
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_config = model.hf_config
    if isinstance(hf_config, ArchConfig):
        factors = getattr(hf_config, "heron_rope_freq_factors", None)
        if factors is not None:  # a GGUF's rope_freqs tensor: transformers holds them as llama3 parameters
            hf_config.rope_parameters = llama3_rope_from_factors(hf_config.rope_parameters, factors)
        hf_config = hf_config.to_transformers()
    hf_config.dtype = str(model.dtype).removeprefix("torch.")  # (torch_dtype before transformers 4.56)
    hf_config.save_pretrained(output_dir)
    load_tokenizer(model).save_pretrained(output_dir)
    logger.info("wrote %s (%d tensors, %s)", output_dir, len(tensors), hf_config.dtype)
    return output_dir


def check_output_directory(output_dir: str) -> None:
    """A ValueError naming ``output_dir`` unless it is new or an empty directory."""
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise ValueError(f"--output {output_dir!r} is a file: give a new or empty directory")
        if os.listdir(output_dir):
            raise ValueError(f"--output {output_dir!r} is not empty: give a new or empty directory (files left "
                             "there, an older checkpoint's shards, would be loaded with the new ones)")


def prepare_output_directory(output_dir: str) -> None:
    """Make ``output_dir``, or check that it is an empty directory (a
    ValueError naming it, not an OSError traceback)."""
    check_output_directory(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output {output_dir!r}: cannot make the directory ({exc.strerror})") from exc


def llama3_rope_from_factors(rope: dict[str, Any], factors: list[float]) -> dict[str, Any]:
    """The llama3 RoPE parameters that give these per-frequency factors (llama.cpp
    stores Llama 3.1+'s scaling as the factors alone): the setting of every
    published model is among the candidates tried. A ValueError when none fits:
    an HF config could not hold the file's RoPE, and the directory would compute
    other logits (the factors were dropped without a word)."""
    theta = float(rope["rope_theta"])
    wanted = torch.tensor(factors, dtype=torch.float64)
    rotary_dim = 2 * len(factors)
    for factor, low, high, original in itertools.product(
            (8.0, 32.0, 16.0, 4.0, 2.0, 64.0), (1.0, 2.0), (4.0, 2.0, 8.0),
            (8192, 4096, 2048, 16384, 32768, 65536, 131072, 1024, 512, 256, 128, 64, 32)):
        candidate = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                     "high_freq_factor": high, "original_max_position_embeddings": original}
        got = (compute_inv_freq(rotary_dim, {"rope_theta": theta}).double()
               / compute_inv_freq(rotary_dim, candidate).double())
        if torch.allclose(got, wanted, rtol=1e-4):
            return {**rope, **candidate}
    raise ValueError("the GGUF's per-frequency RoPE factors (rope_freqs.weight) match no llama3 RoPE setting, and a "
                     "Hugging Face config has no other way to hold them: the converted directory would compute "
                     "other logits")
