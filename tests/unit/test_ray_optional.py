"""Ray is optional: heron imports, serves and routes without it, and asking
for the ray backend without it is a clear error."""

import subprocess
import sys
import time
import types

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


class _FakeRay:
    """Named actors as Ray keeps them: ``ray.remote(cls).options(name=...).remote()``
    adds one (a second of one name is refused), ``ray.util.list_named_actors()`` lists them."""

    def __init__(self):
        self.names = []
        self.util = self

    def list_named_actors(self):
        return list(self.names)

    def remote(self, _cls):
        return self

    def get_runtime_context(self):
        return types.SimpleNamespace(get_node_id=lambda: "ab" * 28)  # the driver's node (a node id's form)

    def options(self, name, **_):
        assert name not in self.names, "Ray refuses a second actor of one name"
        self.names.append(name)
        return types.SimpleNamespace(remote=lambda *args: name)


def test_two_servers_registering_one_url_each_keep_their_own_registration(monkeypatch):
    """Two servers naming one URL (one port on two machines that registered a
    loopback address) shared one named actor: the first to stop unlisted the
    other, and routers dropped a live server."""
    from heron.engine import ray_engines

    fake = _FakeRay()
    monkeypatch.setattr(ray_engines, "connect", lambda address=None: fake)
    fake.names.append("someone-else")  # not a registration
    first = ray_engines.register_replica("http://10.0.0.1:8000")
    ray_engines.register_replica("http://10.0.0.1:8000")
    ray_engines.register_replica("http://10.0.0.2:8000")
    assert ray_engines.discover_replicas() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    fake.names.remove(first)  # the first server stops
    assert ray_engines.discover_replicas() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_port_0_is_refused_with_the_ray_backend():
    """It registered http://HOST:0, which no router reaches (every request a 503)."""
    from heron.entrypoints.cli import build_parser
    from heron.entrypoints.openai.cli_args import check_serve_args

    check_serve_args(build_parser().parse_args(["serve", "--port", "0"]))  # any free port: fine without Ray
    with pytest.raises(ValueError, match="--port 0 .* cannot be registered on the Ray cluster"):
        check_serve_args(build_parser().parse_args(["serve", "--port", "0", "--data-parallel-backend", "ray"]))


def test_a_stop_that_hangs_does_not_hold_the_exit():
    """A Ray-backed server whose cluster went away said it would exit after its
    grace, then hung a minute more in the engines' cleanup (Ray waiting on the
    cluster) until Ray ended it: a supervisor saw it neither serve nor exit."""
    script = ("from heron.entrypoints.openai.server import exit_within\n"
              "import time\nexit_within(0.5, 7)\ntime.sleep(60)\n")
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode == 7 and time.monotonic() - started < 30
    assert "the stop has taken 0.5 s: exiting now (code 7)" in child.stderr
