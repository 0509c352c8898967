"""`heron bench` refuses bad inputs with a sentence, before it sends or loads
anything: percentiles and range ratios out of bounds, a tokenizer that cannot
be loaded, a dataset file given where it is not read or not of its shape, a
result file that is not one, structured outputs of unknown fields."""

from __future__ import annotations

import json
import re

import pytest

from heron.entrypoints.cli import main

UNREACHABLE = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "x", "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


@pytest.mark.parametrize("flags, message", [
    (["--metric-percentiles", "50,150"], "each percentile must be within \\[0, 100\\], got '150'"),
    (["--metric-percentiles", "50,abc"], "expected percentiles such as 50,90,99"),
    (["--random-range-ratio", "-0.5"], "expected a number in \\[0, 1\\)"),
    (["--random-output-range-ratio", "2"], "expected a number in \\[0, 1\\)"),
    (["--burstiness", "inf"], "burstiness"),  # crashed in gammavariate after the first request had gone out
    (["--request-timeout", "0"], "request-timeout"),
])
def test_out_of_bounds_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*UNREACHABLE, *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def run_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_tokenizer_that_cannot_load_is_named(capsys, tmp_path):
    err = run_error([*UNREACHABLE, "--tokenizer", str(tmp_path / "no-such-tokenizer")], capsys)
    assert "heron: error: cannot load the tokenizer" in err and "no-such-tokenizer" in err
    assert "no such file or directory" in err  # a path, not a Hub id ("Repo id must be in the form ...")


def test_a_bad_goodput_bound_names_the_flag(capsys):
    err = run_error([*UNREACHABLE, "--goodput", "ttft:abc"], capsys)
    assert "--goodput expects NAME:MS" in err and "'ttft:abc'" in err


@pytest.mark.parametrize("flags", [["--result-dir", "/proc/no-such-dir", "--save-result"],
                                   ["--result-filename", "/proc/no-such-dir/r.json"]])
def test_a_result_that_cannot_be_saved_is_refused_before_the_run(flags, capsys):
    """It was found once the run had ended, and its result lost."""
    err = run_error([*UNREACHABLE, *flags], capsys)
    assert "cannot save the result in '/proc/no-such-dir'" in err
    assert "requests failed" not in err  # nothing was sent


def test_a_dataset_path_is_refused_where_nothing_reads_it(capsys, tmp_path):
    err = run_error([*UNREACHABLE, "--dataset-path", str(tmp_path / "sg.json")], capsys)
    assert "--dataset-path is read with --dataset-name sharegpt, not random" in err


@pytest.mark.parametrize("content, message", [
    ({"conversations": []}, "is not a ShareGPT file"),
    (["a", "b"], "is not a ShareGPT file"),
    ([{"conversations": ["hi", "there"]}], "turns must be objects"),
    ("{broken", "cannot read the ShareGPT file"),
])
def test_a_sharegpt_file_of_another_shape_is_named(content, message, capsys, tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    err = run_error([*UNREACHABLE, "--dataset-name", "sharegpt", "--dataset-path", str(path)], capsys)
    assert message in err and str(path) in err
    err = run_error([*UNREACHABLE, "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path)], capsys)
    assert "cannot read the ShareGPT file" in err


def test_a_fixed_output_length_takes_any_reply(embedded_tokenizer, tmp_path):
    """``--sharegpt-output-len 2``: the short-reply filter was applied to it, and
    every conversation was skipped."""
    from heron.benchmarks.datasets import sharegpt_dataset

    data = [{"conversations": [{"from": "human", "value": f"Question {i}: why is the sky blue?"},
                               {"from": "gpt", "value": "Rayleigh."}]} for i in range(3)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    samples = sharegpt_dataset(embedded_tokenizer, str(path), num_prompts=3, output_len=2)
    assert [sample.expected_output_len for sample in samples] == [2, 2, 2]


def test_compare_names_a_file_that_is_not_a_result(capsys, tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert "is not a result of heron bench serve" in run_error(["bench", "compare", str(listed)], capsys)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert f"cannot read the result {broken}" in run_error(["bench", "compare", str(broken)], capsys)


def test_structured_outputs_of_unknown_fields_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--structured-outputs", '{"bogus": 1}', "--num-prompts", "1"])
    assert exit_info.value.code == 2 and "unexpected keyword argument 'bogus'" in capsys.readouterr().err
