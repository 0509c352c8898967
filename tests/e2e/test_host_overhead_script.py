"""benchmarks/host_overhead.py runs end to end (a few steps, tiny model)."""

from __future__ import annotations

import re
import sys

from benchmarks import host_overhead


def test_host_overhead_reports_each_batch(tmp_path, monkeypatch, capsys):
    argv = ["host_overhead.py", "--batch", "1", "3", "--steps", "4", "--async-scheduling",
            "--model-dir", str(tmp_path / "model")]
    monkeypatch.setattr(sys, "argv", argv)
    host_overhead.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "per LLMEngine.step" in line]
    assert [int(re.match(r"batch\s+(\d+)", line).group(1)) for line in lines] == [1, 3]
    assert all(float(re.search(r": ([\d.]+) ms", line).group(1)) > 0 for line in lines)
