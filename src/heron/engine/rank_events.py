"""Where each data-parallel rank publishes its KV-cache events: on the user's
endpoint with the port plus the rank, or, when the user asked for none, on a
private endpoint the API server follows (an IPC path on one host, any TCP port
on a Ray node's address). Likewise where a rank serves finished prefills'
blocks (``--kv-transfer-config``): a given ``kv_port`` plus the rank."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from heron.config import EngineConfig, KVEventsConfig, KVTransferConfig
from heron.engine.args import EngineArgs

# the names of this machine's loopback that a Ray actor replaces with its node's address
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def kv_events_of(engine: EngineConfig | EngineArgs) -> KVEventsConfig:
    return engine.kv_events if isinstance(engine, EngineConfig) else KVEventsConfig.from_dict(engine.kv_events_config)


def rank_kv_events(base: KVEventsConfig, rank: int, private_endpoint: str, host: str | None = None) -> KVEventsConfig:
    """``host``: put a wildcard (``*``, ``0.0.0.0``) or loopback host of the
    user's endpoint on this address (a Ray node's: the API server and routers
    on other machines dial it; on loopback the events were the node's alone,
    while its other channels moved to its address, as a loopback ``kv_ip`` does)."""
    if not base.publishes:
        return KVEventsConfig(True, "zmq", private_endpoint)

    def ranked(address: str) -> str:
        if host is not None:
            for local in ("tcp://*:", "tcp://0.0.0.0:", *(f"tcp://{f'[{name}]' if ':' in name else name}:"
                                                         for name in LOOPBACK_HOSTS)):
                if address.lower().startswith(local):
                    address = f"tcp://{f'[{host}]' if ':' in host else host}:" + address[len(local):]
        return port_plus(address, rank)

    return replace(base, endpoint=ranked(base.endpoint),
                   replay_endpoint=None if base.replay_endpoint is None else ranked(base.replay_endpoint))


def check_rank_endpoints(base: KVEventsConfig, size: int) -> None:
    """ValueError, before any engine starts, when two of ``size`` ranks would
    bind the same port: rank r publishes on the endpoint's port + r and serves
    replays on the replay port + r, so a replay port within ``size`` of the
    events port (5557 and 5558 under two ranks) gave rank 1's events rank 0's
    replay port, and one rank died on "Address already in use"."""
    if not base.publishes or size < 2:
        return
    taken: dict[str, str] = {}
    for rank in range(size):
        for name, address in (("endpoint", base.endpoint), ("replay_endpoint", base.replay_endpoint)):
            if address is None or not address.startswith("tcp://") or not address.rsplit(":", 1)[-1].isdigit():
                continue  # a free port, or an IPC path: apart by themselves
            ranked = port_plus(address, rank)
            owner = f"rank {rank}'s {name}"
            if ranked in taken:
                raise ValueError(f"kv_events_config: with --data-parallel-size {size}, {owner} would be {ranked}, "
                                 f"which is {taken[ranked]}: each rank adds its number to both ports, so keep "
                                 f"endpoint and replay_endpoint at least {size} apart")
            taken[ranked] = owner


def port_plus(address: str, rank: int) -> str:
    """``tcp://host:5557`` -> ``tcp://host:5557+rank``; a ``*`` port and IPC paths stay apart by themselves."""
    if address.startswith("tcp://"):
        host, _, port = address.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + rank}"
        return address
    return f"{address}-{rank}"


def with_kv_events(engine: EngineConfig | EngineArgs, events: KVEventsConfig) -> EngineConfig | EngineArgs:
    if isinstance(engine, EngineArgs):
        as_dict: dict[str, Any] = {spec.name: getattr(events, spec.name) for spec in fields(KVEventsConfig)}
        return replace(engine, kv_events_config=as_dict)
    return replace(engine, kv_events=events)


def with_rank_kv_transfer(engine: EngineConfig | EngineArgs, rank: int,
                          host: str | None = None) -> EngineConfig | EngineArgs:
    """Rank ``rank``'s block server: a given ``kv_port`` plus the rank (0 stays any
    free port); ``host``: the node's address, replacing a loopback ``kv_ip`` (a
    Ray actor's blocks must be reachable from other machines)."""
    config = (engine.kv_transfer if isinstance(engine, EngineConfig)
              else KVTransferConfig.from_dict(engine.kv_transfer_config))
    if config is None:
        return engine
    changes: dict[str, Any] = {}
    if config.kv_port:
        changes["kv_port"] = config.kv_port + rank
    if host is not None and config.kv_ip.lower() in LOOPBACK_HOSTS:
        changes["kv_ip"] = host
    if not changes:
        return engine
    ranked = replace(config, **changes)
    if isinstance(engine, EngineArgs):
        return replace(engine, kv_transfer_config={spec.name: getattr(ranked, spec.name)
                                                   for spec in fields(KVTransferConfig)})
    return replace(engine, kv_transfer=ranked)
