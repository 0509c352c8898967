"""benchmarks/host_overhead.py, output_processing_time.py and
sampling_metadata_time.py run end to end (a few steps, tiny model)."""

from __future__ import annotations

import re
import sys

from benchmarks import host_overhead, output_processing_time, sampling_metadata_time


def test_host_overhead_reports_each_batch(tmp_path, monkeypatch, capsys):
    argv = ["host_overhead.py", "--batch", "1", "3", "--steps", "4", "--async-scheduling", "--phases",
            "--model-dir", str(tmp_path / "model")]
    monkeypatch.setattr(sys, "argv", argv)
    host_overhead.main()
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if "per LLMEngine.step" in line]
    assert [int(re.match(r"batch\s+(\d+)", line).group(1)) for line in lines] == [1, 3]
    assert all(float(re.search(r": ([\d.]+) ms", line).group(1)) > 0 for line in lines)
    phases = [line for line in out if "ms per step:" in line]
    assert len(phases) == 2 and all(float(re.search(r"process_outputs ([\d.]+)", line).group(1)) > 0 for line in phases)


def test_output_processing_time_checks_identical_texts(monkeypatch, capsys):
    digests = []
    for kind in ("final_only", "delta"):
        argv = ["output_processing_time.py", "--batch", "4", "--steps", "70", "--repeats", "1", "--kind", kind]
        monkeypatch.setattr(sys, "argv", argv)
        output_processing_time.main()
        line = capsys.readouterr().out.strip()
        assert float(re.search(r": ([\d.]+) ms per step", line).group(1)) > 0
        digests.append(re.search(r"md5 (\w+)", line).group(1))
    assert digests[0] == digests[1]  # detokenized in batches or streamed: the same text


def test_sampling_metadata_time_reports_both_ways(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sampling_metadata_time.py", "--batch", "8"])
    sampling_metadata_time.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(",")[0] for line in lines] == ["greedy", "top-p/top-k"]
    assert all(float(v) > 0 for line in lines for v in re.findall(r"(\d+) us", line))
