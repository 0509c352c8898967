"""Ray is optional: heron imports, serves and routes without it, and asking
for the ray backend without it is a clear error."""

import sys

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
