"""A Ctrl-C or SIGTERM while ``heron`` starts ends it with no traceback: in the
parser's imports, and in an engine core whose launcher has already cleaned up."""

from __future__ import annotations

import subprocess
import sys

import pytest

from heron.entrypoints import cli


def test_a_ctrl_c_while_the_parser_imports_its_modules_exits_130(monkeypatch):
    """The parser imports the serve, bench and router modules (a second or two);
    a Ctrl-C then escaped main as a KeyboardInterrupt traceback."""

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        exit_code = cli.main(["serve"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main")
    assert exit_code == 130


def test_an_engine_core_whose_launcher_already_removed_its_directory_exits_quietly(tmp_path):
    """A launcher stopped right after starting a core removes its private
    directory, start file included: the core printed a FileNotFoundError traceback."""
    start_path = tmp_path / "gone" / "start.pickle"
    run = subprocess.run([sys.executable, "-m", "heron.engine.core_proc", str(start_path), "INFO", "1"],
                         capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (0, "")
