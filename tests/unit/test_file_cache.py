"""The weight cache keeps what a start can read and nothing else (loader/file_cache.py)."""

from __future__ import annotations

import os

import torch

from heron.loader.file_cache import entry_path, save_entry


def _entry(source: str, version: str = "v1", kind: str = "float") -> str:
    path = entry_path(kind, [source], version)
    assert path is not None
    save_entry(path, {"w": torch.arange(4.0)}, [source])
    return path


def test_a_write_removes_the_entries_no_start_can_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint, other, gone = (tmp_path / name for name in ("model.gguf", "other.gguf", "gone.gguf"))
    for path in (checkpoint, other, gone):
        path.write_bytes(b"weights")
    first = _entry(str(checkpoint))
    packed = _entry(str(checkpoint), kind="int4")  # another kind of the same checkpoint: kept
    kept = _entry(str(other))
    orphan = _entry(str(gone))
    directory = os.path.dirname(first)
    legacy = os.path.join(directory, "0123456789abcdef0123.safetensors")  # named before the scheme
    with open(legacy, "wb") as handle:
        handle.write(b"old")
    partial = os.path.join(directory, "x.safetensors.12.partial")  # a write under way elsewhere
    with open(partial, "wb") as handle:
        handle.write(b"")
    gone.unlink()
    os.utime(checkpoint, ns=(1, 1))  # the checkpoint changed: a new version
    second = _entry(str(checkpoint))
    assert second != first
    assert sorted(os.listdir(directory)) == sorted(os.path.basename(p) for p in (second, packed, kept, partial))
    assert not os.path.exists(orphan)


def test_the_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_DISABLE_WEIGHT_CACHE", "1")
    (tmp_path / "model.gguf").write_bytes(b"weights")
    assert entry_path("float", [str(tmp_path / "model.gguf")], "v1") is None
