"""The disk tier's layout fingerprint covers every weight byte, and the digest
of a weight file is computed once per version of the file."""

from __future__ import annotations

import os

from heron.core import weight_digest
from heron.core.kv_disk_layout import layout_fingerprint


def write_weights(directory, middle_of_the_first_half: bytes) -> str:
    directory.mkdir()
    content = bytearray(b"\x01" * (8 << 20))
    content[2 << 20:(2 << 20) + len(middle_of_the_first_half)] = middle_of_the_first_half  # no sample read it
    (directory / "model.safetensors").write_bytes(bytes(content))
    return str(directory)


def test_checkpoints_that_differ_anywhere_get_different_fingerprints(tmp_path, monkeypatch):
    """Samples of start, middle and end named a checkpoint changed elsewhere
    (one layer scaled) like the other: its K/V was served the other's files."""
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    first = write_weights(tmp_path / "a", b"original")
    second = write_weights(tmp_path / "b", b"finetune")
    same = write_weights(tmp_path / "c", b"original")
    assert layout_fingerprint(first, None, ["float32"]) != layout_fingerprint(second, None, ["float32"])
    assert layout_fingerprint(first, None, ["float32"]) == layout_fingerprint(same, None, ["float32"])


def test_a_files_digest_is_read_whole_once_per_version(tmp_path, monkeypatch):
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "cache"))
    path = os.path.join(write_weights(tmp_path / "m", b"v1"), "model.safetensors")
    reads: list[str] = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        if file == path and "b" in mode:
            reads.append(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(weight_digest, "open", counting_open, raising=False)
    first = weight_digest.weights_digest(path)
    assert weight_digest.weights_digest(path) == first and len(reads) == 1  # the kept digest
    with real_open(path, "r+b") as file:  # new weights written over the old: a new version
        file.seek(5 << 20)
        file.write(b"changed")
    assert weight_digest.weights_digest(path) != first and len(reads) == 2
