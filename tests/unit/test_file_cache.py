"""The weight cache keeps what a start can read and nothing else (loader/file_cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
    os.utime(checkpoint, ns=(1, 1))  # the checkpoint changed: a new version; the one before is kept
    second = _entry(str(checkpoint))
    assert second != first
    listed = sorted(os.listdir(directory))
    assert listed == sorted(os.path.basename(p) for p in (first, second, packed, kept, partial))
    assert not os.path.exists(orphan)
    os.utime(checkpoint, ns=(2, 2))  # and again: only the newest older version stays
    third = _entry(str(checkpoint))
    assert not os.path.exists(first) and os.path.exists(second) and os.path.exists(third)


def test_a_write_removes_partial_files_whose_writer_died(tmp_path, monkeypatch):
    """A start killed while writing an entry leaves its partial file (0.5 GB for the
    embedded model's float weights); the next write removes it once it is old and
    its writer is gone, and leaves every write that may still be under way."""
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = tmp_path / "model.gguf"
    checkpoint.write_bytes(b"weights")
    directory = os.path.dirname(_entry(str(checkpoint)))
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(finished.stdout)  # a pid no process has any more
    hour_ago = time.time() - 3600
    cases = {"abandoned": (dead, hour_ago), "writer alive": (os.getpid(), hour_ago), "just begun": (dead, time.time())}
    for label, (pid, modified) in cases.items():
        path = os.path.join(directory, f"{label.replace(' ', '-')}.safetensors.{pid}.partial")
        with open(path, "wb") as handle:
            handle.write(b"half")
        os.utime(path, (modified, modified))
    _entry(str(checkpoint), "v2")
    left = sorted(name for name in os.listdir(directory) if name.endswith(".partial"))
    assert left == sorted([f"just-begun.safetensors.{dead}.partial", f"writer-alive.safetensors.{os.getpid()}.partial"])


def test_two_versions_written_in_turns_both_stay(tmp_path, monkeypatch):
    """Two heron trees started in turns (a comparison) with different packing
    code: neither removes the other's entry, so neither rebuilds at every start."""
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = tmp_path / "model.gguf"
    checkpoint.write_bytes(b"weights")
    one, two = _entry(str(checkpoint), "tree one", "int4"), _entry(str(checkpoint), "tree two", "int4")
    assert _entry(str(checkpoint), "tree one", "int4") == one
    assert os.path.exists(one) and os.path.exists(two)


def test_the_cache_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_DISABLE_WEIGHT_CACHE", "1")
    (tmp_path / "model.gguf").write_bytes(b"weights")
    assert entry_path("float", [str(tmp_path / "model.gguf")], "v1") is None


def _write_warned(tmp_path, caplog) -> str:
    """Writes an entry for a fresh checkpoint, expecting a warning, not an exception."""
    checkpoint = tmp_path / "model.gguf"
    checkpoint.write_bytes(b"weights")
    path = entry_path("float", [str(checkpoint)], "v1")
    assert path is not None
    with caplog.at_level("WARNING", logger="heron.loader.file_cache"):
        save_entry(path, {"w": torch.arange(4.0)}, [str(checkpoint)])
    return path


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HERON_CACHE_DIR", str(blocker / "cache"))
    path = _write_warned(tmp_path, caplog)
    assert not os.path.exists(path) and "HERON_CACHE_DIR" in caplog.text


def test_a_file_copied_in_with_its_old_time_gets_an_entry_of_its_own(tmp_path, monkeypatch):
    """Same size, same modification time (cp -p, rsync -t, tar), other bytes:
    the key was path, size and mtime, so the old weights came back for it."""
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"a" * 64)
    before = entry_path("float", [str(source)], "v1")
    stat = os.stat(source)
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(b"b" * 64)
    os.replace(replacement, source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(source).st_mtime_ns == stat.st_mtime_ns and os.stat(source).st_size == stat.st_size
    assert entry_path("float", [str(source)], "v1") != before



def test_a_full_disk_is_a_warning_and_leaves_no_partial_file(tmp_path, monkeypatch, caplog):
    """safetensors reports a failed write (ENOSPC, EFBIG) as its own SafetensorError,
    not OSError: it escaped, and the model did not load."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    path = _write_warned(tmp_path, caplog)
    assert "File too large" in caplog.text and os.listdir(os.path.dirname(path)) == []


def test_a_damaged_entry_is_removed_to_be_built_again(tmp_path, monkeypatch):
    """A truncated entry failed every later start until someone found and deleted it."""
    from heron.loader.weights import _readable_entry

    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model.gguf").write_bytes(b"weights")
    path = _entry(str(tmp_path / "model.gguf"))
    assert _readable_entry(path)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 4)
    assert not _readable_entry(path) and not os.path.exists(path)
