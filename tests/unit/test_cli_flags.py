"""The ``heron`` command's flags: values it cannot use are usage errors (exit
2, naming the flag) before anything loads, and the flags a vLLM user places
after the subcommand are taken there."""

from __future__ import annotations

import pytest

from heron.entrypoints.cli import build_parser


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--kv-cache-memory-bytes", "inf"],  # an OverflowError traceback
    ["generate", "hi", "--kv-cache-memory-bytes=-1GiB"],
    ["serve", "--max-request-body-bytes", "1e400"],
    ["serve", "--max-header-bytes=-1"],  # taken: then every request, /health too, got a 431
    ["serve", "--max-header-bytes", "0"],
    ["serve", "--max-request-body-bytes", "lots"],
])
def test_a_size_that_is_not_a_finite_positive_count_of_bytes_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "expected a" in error and "Traceback" not in error, error


def test_sizes_keep_their_units():
    args = build_parser().parse_args(["serve", "--max-request-body-bytes", "2MiB", "--kv-cache-memory-bytes", "1e9"])
    assert args.max_request_body_bytes == 2 << 20 and args.kv_cache_memory_bytes == 10**9


@pytest.mark.parametrize("argv, level", [
    (["serve"], "INFO"),
    (["serve", "--log-level", "DEBUG"], "DEBUG"),  # "unrecognized arguments" after the subcommand
    (["--log-level", "warning", "serve"], "WARNING"),  # lower case was refused
    (["--log-level", "ERROR", "serve", "--log-level", "debug"], "DEBUG"),  # the nearer one wins
    (["bench", "serve", "--log-level", "error"], "ERROR"),  # at every depth
    (["router", "--replica", "http://127.0.0.1:1", "--log-level", "WARNING"], "WARNING"),
])
def test_log_level_is_taken_before_or_after_the_subcommand_in_any_case(argv, level):
    assert build_parser().parse_args(argv).log_level == level


def test_a_seed_torch_cannot_take_is_named_before_the_engine_starts():
    """It killed the engine core at start on an "Overflow when unpacking long
    long" that named no flag (and a server answered 503 for 5 s, then exited)."""
    from heron.engine.args import EngineArgs

    args = build_parser().parse_args(["serve", "--seed", "99999999999999999999999"])
    with pytest.raises(ValueError, match="seed must be an integer in"):
        EngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "0"), ("--max-tokens", "0"),
                                         ("--stop", "")])
def test_a_bad_sampling_flag_is_named_before_the_model_loads(command, flag, value, monkeypatch):
    """It was named only after the model had loaded (26 s for the embedded one)."""
    from heron.entrypoints import terminal

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(terminal, "LLMEngine", no_load)
    argv = [command, *(["hi"] if command == "generate" else []), flag, value]
    run = terminal.run_generate if command == "generate" else terminal.run_chat
    with pytest.raises(ValueError):
        run(build_parser().parse_args(argv))
