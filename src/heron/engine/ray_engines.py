"""Engine cores as Ray actors: ``heron serve --data-parallel-size N
--data-parallel-backend ray`` on a running Ray cluster (``ray start --head`` on
one machine, ``ray start --address HEAD:6379`` on the others; heron installed
on each).

The API server is a Ray driver (``RAY_ADDRESS``, default ``auto``: the cluster
this machine belongs to). It reserves one bundle per engine core in a
placement group (spread over the nodes where it can), starts an
``EngineCoreActor`` in each, and talks to them over TCP: each actor binds its
node's address (``ClientChannels.bound``) and the API server connects, so
nothing needs to know the API server's address in advance. The actors publish
their KV-cache events on their node's address too, so the API server's
placement follows each engine's cache as with local processes.

An actor's ``run()`` returns only when its engine stops; the API server
watches that call to tell a live engine from a dead one. The actors belong to
the API server's Ray job: they end with it. A server on Ray also registers its
URL as a named actor (``replica:<url>`` in the ``heron`` namespace), which
``heron router --ray-address`` lists to find its replicas.

Ray is optional (``pip install 'heron[ray]'``): nothing here imports it until
the ray backend is asked for.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from heron import envs
from heron.config import EngineConfig
from heron.engine.args import EngineArgs
from heron.engine.core_channels import ClientAddresses, ClientChannels
from heron.engine.core_client import UNKNOWN_EXIT_CODE, EngineCoreEndpoint
from heron.engine.rank_events import kv_events_of, rank_kv_events, with_kv_events, with_rank_kv_transfer

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "heron"
REPLICA_PREFIX = "replica:"
_REGISTRATION_SEPARATOR = "#"  # between a registered URL and its registration's own suffix
_PLACEMENT_TIMEOUT_S = 60.0
_GCS_CONNECT_TIMEOUT_S = 5.0  # a cluster's head answers a connection at once; a host that drops packets does not


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError("the ray backend needs Ray: pip install 'heron[ray]'") from exc
    return ray


def connect(address: str | None = None) -> Any:
    """Join the Ray cluster at ``address`` (default ``RAY_ADDRESS``, else the one
    this machine belongs to) as a driver in heron's namespace."""
    ray = import_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "auto"
        check_cluster_answers(address)
        try:
            ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise ValueError(f"no Ray cluster at {address!r} (start one with `ray start --head`): {exc}") from exc
    return ray


def check_cluster_answers(address: str, timeout_s: float = _GCS_CONNECT_TIMEOUT_S) -> None:
    """A ValueError unless the cluster ``address`` names (``auto``: the one this
    machine last joined) accepts a connection: ray.init retries an address where
    nothing answers for ever, with no word from heron (a typo in RAY_ADDRESS, a
    cluster gone since). Ray Client addresses (``ray://``) and ``local`` (a
    cluster Ray starts) are left to Ray."""
    import_ray()
    if address.startswith("ray://") or address == "local":  # local: Ray starts a cluster of its own
        return
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # another Ray: its own error, however late
        return
    try:
        resolved = canonicalize_bootstrap_address(address)
    except Exception as exc:  # noqa: BLE001 (Ray's own: a malformed address, several clusters for auto)
        raise ValueError(f"no Ray cluster at {address!r}: {exc}") from exc
    if resolved is None:
        raise ValueError(f"no Ray cluster at {address!r} (start one with `ray start --head`, or set RAY_ADDRESS)")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        named = (f" (the cluster this machine last joined, {resolved})" if address == "auto"
                 else "" if resolved == address else f" ({resolved})")
        raise ValueError(f"no Ray cluster answers at {address!r}{named}: {exc}; start one with `ray start --head` "
                         f"or set RAY_ADDRESS to a running one") from exc


class EngineCoreActor:
    """One engine core in a Ray worker process (wrapped by ``ray.remote`` at start)."""

    def __init__(self, engine: EngineConfig | EngineArgs, rank: int, num_clients: int, log_level: str) -> None:
        import ray

        from heron.engine.core_proc import configure_engine_logging

        configure_engine_logging(log_level)
        self.node_ip = ray.util.get_node_ip_address()
        events = kv_events_of(engine)
        if engine.data_parallel_size > 1 or events.publishes:  # the API server follows them, over TCP
            events = rank_kv_events(events, rank, f"tcp://{self.node_ip}:*", host=self.node_ip)
        self.engine = with_rank_kv_transfer(with_kv_events(engine, events), rank, host=self.node_ip)
        self.context = zmq.Context()
        self.channels = ClientChannels.bound(self.context, self.node_ip, num_clients)

    def addresses(self) -> tuple[str, list[ClientAddresses]]:
        """The node this actor runs on (Ray's node id), and where each API server connects."""
        import ray

        return ray.get_runtime_context().get_node_id(), self.channels.addresses

    def run(self) -> None:
        """Load the model and serve until told to stop (raises if the engine fails)."""
        from heron.engine.core_proc import EngineCoreProc, build_engine

        EngineCoreProc(build_engine(self.engine, self.channels), self.channels).run()


@dataclass
class RayEngineCore:
    """The API server's handle on one engine-core actor (an ``OwnedEngineCore``)."""

    actor: Any
    run_ref: Any  # the actor's run() call: done when the engine has stopped
    node_id: str
    clients: list[ClientAddresses]
    release: Callable[[], None]  # the placement group goes when every core has stopped

    def endpoint(self, client: int) -> EngineCoreEndpoint:
        return EngineCoreEndpoint(None, self.clients[client])

    def exit_code(self) -> int | None:
        """0 once its engine stopped when told, else UNKNOWN_EXIT_CODE: an actor has
        no exit code (every death read "exited (code 1)"), ``how_it_ended`` says more."""
        ended, failure = self._outcome()
        return None if not ended else UNKNOWN_EXIT_CODE if failure is not None else 0

    def how_it_ended(self) -> str | None:
        """Ray's word on the actor's death (its worker killed, its node gone) or the
        error its engine raised; None while it runs or once it stopped cleanly."""
        return self._outcome()[1]

    def _outcome(self) -> tuple[bool, str | None]:
        """Whether ``run()`` has returned, and how it failed if it did."""
        ray = import_ray()
        done, _ = ray.wait([self.run_ref], timeout=0)
        if not done:
            return False, None
        try:
            ray.get(self.run_ref)
        except Exception as exc:  # noqa: BLE001 (the actor or its engine died; its log says more)
            return True, _how_the_actor_ended(exc)
        return True, None

    def wait(self, timeout: float) -> bool:
        done, _ = import_ray().wait([self.run_ref], timeout=timeout)
        return bool(done)

    def stop(self, timeout: float = 5.0) -> None:
        if not self.wait(timeout):
            self.kill()
        else:
            self.release()

    def kill(self) -> None:
        import_ray().kill(self.actor)
        self.release()


def start_ray_engine_cores(engine: EngineConfig | EngineArgs, log_level: str = "INFO",
                           num_clients: int = 1) -> list[RayEngineCore]:
    """Place one engine-core actor per data-parallel rank on the Ray cluster."""
    ray = connect()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    size = engine.data_parallel_size
    bundle = _bundle(engine, ray)
    group = placement_group([bundle] * size, strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 (GetTimeoutError and friends)
        remove_placement_group(group)
        raise ValueError(f"the Ray cluster cannot place {size} engine core(s) of {bundle} each "
                         f"(available: {ray.available_resources()}): {exc}") from exc
    remaining = [size]

    def release() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            remove_placement_group(group)

    actor_class = ray.remote(EngineCoreActor)
    threads = {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(bundle["CPU"])))}}
    actors = [
        actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env=threads,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank))
        .remote(engine, rank, num_clients, log_level)
        for rank in range(size)
    ]
    placed = ray.get([actor.addresses.remote() for actor in actors])
    cores = [RayEngineCore(actor, actor.run.remote(), node_id, clients, release)
             for actor, (node_id, clients) in zip(actors, placed, strict=True)]
    logger.info("%d engine core(s) on Ray nodes %s", size, ", ".join(core.node_id for core in cores))
    return cores


def _bundle(engine: EngineConfig | EngineArgs, ray: Any) -> dict[str, float]:
    """What one engine core reserves: a GPU when the engine runs on CUDA (or
    ``auto`` on a cluster that has a GPU per engine), and CPUs."""
    cpus = envs.positive_number(envs.HERON_RAY_CPUS_PER_ENGINE, 1.0, zero=True)  # 0: only a GPU, as Ray allows
    device = engine.device_name if isinstance(engine, EngineConfig) else engine.device
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "cuda" or (device == "auto" and gpus >= engine.data_parallel_size):
        return {"CPU": cpus, "GPU": 1.0}
    return {"CPU": cpus}


def _how_the_actor_ended(error: BaseException) -> str:
    """A line for clients: Ray's reason for an actor's death (its message's first
    line past the actor's id fields), or the exception its engine raised."""
    ray = import_ray()
    if isinstance(error, ray.exceptions.RayActorError):
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip() and not line.startswith("\t")]
        detail = lines[0] if lines else (str(error).splitlines() or [type(error).__name__])[0]
        return f"the engine core's Ray actor died: {detail[:300]}"
    cause = getattr(error, "cause", None) or error
    first_line = (str(cause).splitlines() or [""])[0]
    return f"the engine core failed: {type(cause).__name__}{': ' + first_line[:300] if first_line else ''}"


# ---- replica discovery (heron router --ray-address) ----------------------------------


class ReplicaRegistration:
    """Holds a name while its server runs (a named actor ends with its driver).
    It runs on the server's node and is restarted when its process dies (an
    out-of-memory kill): placed anywhere, and gone for good with its process
    or node, it left a healthy server unlisted for every router."""

    def __init__(self, url: str) -> None:
        import sys

        print(f"holds the registration of {url}", file=sys.stderr, flush=True)  # in the server's log (Ray's)


def this_node_ip() -> str:
    return str(connect().util.get_node_ip_address())


def register_replica(url: str) -> Any:
    """Make this server findable by routers on the cluster; returns the handle to keep.
    Each registration has a name of its own (the URL and a random suffix): two
    servers naming one URL (the same port on two machines that both registered
    a loopback address) shared one, and the first to stop unlisted the other."""
    ray = connect()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = f"{REPLICA_PREFIX}{url}{_REGISTRATION_SEPARATOR}{secrets.token_hex(6)}"
    on_this_node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(ReplicaRegistration).options(
        name=name, num_cpus=0, max_restarts=-1, scheduling_strategy=on_this_node).remote(url)


def discover_replicas() -> list[str]:
    """The URLs of the heron servers registered on the cluster (each once)."""
    ray = connect()
    names = ray.util.list_named_actors()
    return sorted({_registered_url(name) for name in names if name.startswith(REPLICA_PREFIX)})


def _registered_url(name: str) -> str:
    """The URL a registration's name carries (one without a suffix: an older heron's)."""
    url = name.removeprefix(REPLICA_PREFIX)
    return url.rpartition(_REGISTRATION_SEPARATOR)[0] or url
