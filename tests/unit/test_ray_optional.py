"""Ray is optional: heron imports, serves and routes without it, and asking
for the ray backend without it is a clear error."""

import subprocess
import sys
import time

import pytest

from heron.engine.args import EngineArgs


def test_without_ray_installed_the_ray_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    from heron.engine.dp_client import start_engine_cores
    from heron.engine.ray_engines import connect

    with pytest.raises(ValueError, match=r"pip install 'heron\[ray\]'"):
        start_engine_cores(EngineArgs(data_parallel_size=2, data_parallel_backend="ray", usage="serve"))
    with pytest.raises(ValueError, match=r"pip install 'heron\[ray\]'"):
        connect("auto")


def test_the_ray_backend_is_for_heron_serve():
    with pytest.raises(ValueError, match="behind heron serve"):
        EngineArgs(data_parallel_backend="ray").create_engine_config()
    with pytest.raises(ValueError, match="choose from|one of|mp"):
        EngineArgs(data_parallel_backend="spark", usage="serve").create_engine_config()


def test_a_ray_address_where_nothing_answers_is_a_clear_error_at_once():
    """ray.init retries an address where nothing answers for ever: heron serve
    and heron router hung with Ray's retries in the log and no word of heron's
    (a typo in RAY_ADDRESS, or auto naming a cluster that is gone). In a child
    process, so a hang is a failed test rather than a stuck suite."""
    pytest.importorskip("ray")
    from tests.e2e.server_process import free_port

    script = ("from heron.engine.ray_engines import connect\n"
              f"try:\n    connect('127.0.0.1:{free_port()}')\nexcept ValueError as exc:\n    print(exc)\n")
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "no Ray cluster answers at '127.0.0.1:" in child.stdout, (child.stdout, child.stderr[-2000:])
    assert time.monotonic() - started < 30
