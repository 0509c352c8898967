"""Private temporary directories are swept once their owner is dead, however it
died, and never while it lives or while one is being made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from heron import tempdirs
from heron.tempdirs import LOCK_NAME, make_private_dir, remove_private_dir, sweep_stale_dirs

OWNER = """
import sys, time
from heron.tempdirs import make_private_dir
print(make_private_dir(sys.argv[1]), flush=True)
time.sleep(600)
"""


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def start_owner(root: Path, prefix: str) -> tuple[subprocess.Popen[str], str]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, prefix], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(root)})
    assert owner.stdout is not None
    directory = owner.stdout.readline().strip()
    assert os.path.isdir(directory) and os.path.dirname(directory) == str(root), directory
    return owner, directory


def test_a_killed_owners_directory_is_swept_and_a_live_ones_is_kept(tmp_root: Path):
    killed, killed_dir = start_owner(tmp_root, "heron-api-")
    alive, alive_dir = start_owner(tmp_root, "heron-ipc-")
    try:
        Path(killed_dir, "gateway").write_bytes(b"\0" * 1024)
        assert sweep_stale_dirs() == []  # both owners live
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        ours = make_private_dir("heron-dp-")  # making one sweeps
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(alive_dir)
        assert sweep_stale_dirs() == []  # our own directory is not stale either
        remove_private_dir(ours)
        assert not os.path.exists(ours) and ours not in tempdirs._held
    finally:
        alive.kill()
        alive.wait(10)
    assert sweep_stale_dirs() == [alive_dir]


def test_a_directory_without_its_lock_file_or_not_heron_s_is_left_alone(tmp_root: Path):
    being_made = tmp_root / "heron-ipc-abc123"  # mkdtemp made it; the lock is not in place yet
    being_made.mkdir()
    Path(being_made, f"{LOCK_NAME}.12345").touch()
    other = tmp_root / "someone-else"
    other.mkdir()
    Path(other, LOCK_NAME).touch()
    link = tmp_root / "heron-dp-link"
    link.symlink_to(other)
    assert sweep_stale_dirs() == []
    assert being_made.is_dir() and other.is_dir() and link.is_symlink()


def test_an_unknown_prefix_is_refused(tmp_root: Path):
    with pytest.raises(ValueError, match="unknown private directory prefix"):
        make_private_dir("heron-other-")
