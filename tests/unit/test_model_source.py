"""Where a model argument leads (loader/model_source.py): a missing file is
named as missing, and a Hub id behind a connection that never answers fails
with the usual message instead of waiting for ever."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from heron.loader.model_source import ModelNotFoundError, default_model_path, resolve_model_source


@pytest.mark.parametrize("name", ["models/missing.gguf", "missing.gguf", "org/weights.safetensors"])
def test_a_missing_model_file_is_not_taken_for_a_hub_id(name):
    """"could not fetch 'models/missing.gguf' from the Hugging Face Hub" (and,
    with a network, an attempt to download it first)."""
    with pytest.raises(ModelNotFoundError, match=f"model '{name}' not found"):
        resolve_model_source(name)


def test_a_hub_id_behind_a_silent_proxy_fails_within_the_bound():
    """A proxy that accepts and never answers held `heron serve --model org/name`
    for good: huggingface_hub's client waits without a timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept_and_say_nothing() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {**os.environ, "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "HF_HUB_OFFLINE": "0",
           "HERON_HUB_TIMEOUT_S": "1", "HF_HOME": os.path.join(os.environ.get("TMPDIR", "/tmp"), "heron-no-hub")}
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    code = ("from heron.loader.model_source import resolve_model_source\n"
            "try:\n    resolve_model_source('someorg/somemodel')\n"
            "except ValueError as exc:\n    print(exc)\n")
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    finally:
        listener.close()
        for connection in held:
            connection.close()
    assert "could not fetch 'someorg/somemodel'" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - started < 60


def test_a_sharded_hub_checkpoint_fetches_only_the_shards_its_index_names(monkeypatch, tmp_path):
    """Every *.safetensors was fetched: a repository holding the weights again in
    another layout (Mistral's consolidated.safetensors beside the HF shards)
    downloaded the whole model twice. The hub is stood in for (no network here)."""
    import json
    from types import SimpleNamespace

    import huggingface_hub

    from heron.loader import model_source

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors",
                                                "c": "model-00001-of-00002.safetensors"}}))
    files = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "consolidated.safetensors", "tokenizer.json"]
    asked: dict[str, object] = {}
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo, timeout: SimpleNamespace(
        siblings=[SimpleNamespace(rfilename=name) for name in files]))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, etag_timeout: str(index))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns, etag_timeout: asked.setdefault("patterns", allow_patterns))
    patterns = model_source._download_from_hub("org/sharded")  # noqa: SLF001
    assert "*.safetensors" not in patterns and "consolidated.safetensors" not in patterns
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "*.json"} <= set(patterns)
    # a repository of one file (no index) is fetched as before
    files.remove("model.safetensors.index.json")
    asked.clear()
    assert "*.safetensors" in model_source._download_from_hub("org/single")  # noqa: SLF001


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_hub_timeout_is_named_not_reported_as_the_network(monkeypatch, value):
    """HERON_HUB_TIMEOUT_S=abc said the Hub could not be reached ("could not
    convert string to float"); 0, -1 and nan were taken."""
    from heron.loader import model_source

    monkeypatch.setenv("HERON_HUB_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"HERON_HUB_TIMEOUT_S={value!r}: expected a finite number above 0"):
        model_source._download_from_hub("someorg/somemodel")


def test_a_gguf_file_is_known_by_its_magic_or_any_case_of_its_suffix(tmp_path):
    """`Model.GGUF`, or a Hugging Face cache's blob (no suffix at all), was "a file
    but not a .gguf file"; llama.cpp and vLLM read them."""
    from types import SimpleNamespace

    from heron.loader.model_source import resolve_tokenizer_source
    from heron.loader.tokenizer import load_tokenizer

    for name, served in (("Model.GGUF", "Model"), ("blob", "blob")):
        os.symlink(default_model_path(), tmp_path / name)
        source = resolve_model_source(str(tmp_path / name))
        assert (source.format, source.name) == ("gguf", served)
        assert resolve_tokenizer_source(str(tmp_path / name)) == str(tmp_path / name)
    tokenizer = load_tokenizer(SimpleNamespace(tokenizer=None, model=str(tmp_path / "blob")))
    assert tokenizer.decode(tokenizer.encode("Hello herons")) == "Hello herons"
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ModelNotFoundError, match="is a file but not a GGUF file"):
        resolve_model_source(str(tmp_path / "weights.bin"))
