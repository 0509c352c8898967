"""What `heron serve`'s API process does before the engine core is ready: it
resolves the same flags as the engine core (checked to agree), without
importing torch (the engine core, started first, loads the model meanwhile)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from heron.engine.args import EngineArgs
from heron.engine.async_llm import _resolution_mismatch


def test_the_api_process_resolves_its_config_without_torch():
    code = (
        "import sys\n"
        "from heron.engine.args import EngineArgs\n"
        "from heron.loader.tokenizer import load_tokenizer\n"
        "import heron.entrypoints.openai.server\n"
        "config = EngineArgs(usage='serve').create_engine_config()\n"
        "load_tokenizer(config.model)\n"
        "assert config.device_name == 'cpu' and config.model.quantization == 'int4', config\n"
        "assert 'torch' not in sys.modules, 'the API process imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_differently_resolved_engine_core_is_caught():
    config = EngineArgs(device="cpu", max_model_len=256).create_engine_config()
    same = config.resolved_summary()
    assert _resolution_mismatch(config, same) == ""
    other = {**same, "max_model_len": 512, "quantization": "none"}
    mismatch = _resolution_mismatch(config, other)
    assert "max_model_len 256 here, 512 there" in mismatch and "quantization" in mismatch


def test_bad_flags_fail_fast_and_leave_no_engine_core(tmp_path):
    """The engine core starts before the flags are checked here; a bad flag still
    ends the command at once with the reason, and the started core with it."""
    def engine_cores() -> set[str]:
        listing = subprocess.run(["pgrep", "-f", "heron.engine.core_proc"], capture_output=True, text=True)
        return set(listing.stdout.split())

    before = engine_cores()
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", "0",
         "--model", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "missing.gguf" in result.stderr
    assert time.monotonic() - started < 60
    assert engine_cores() <= before  # (an orphan would linger a second before its watchdog ends it)


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_a_port_in_use_fails_before_any_engine_core_starts(api_servers):
    """The port was taken only once the model had loaded (uvicorn's bare errno,
    exit 3, after the engine core's whole start); a second pool on the port
    joined the first (found by the lifecycle review)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "heron.entrypoints.cli", "serve", "--port", str(port),
             "--api-server-count", api_servers, "--log-level", "DEBUG"],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 2, result.stderr
    assert f"heron: error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "engine core" not in result.stderr.lower()  # none was started
