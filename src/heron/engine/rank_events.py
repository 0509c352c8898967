"""Where each data-parallel rank publishes its KV-cache events: on the user's
endpoint with the port plus the rank, or, when the user asked for none, on a
private endpoint the API server follows (an IPC path on one host, any TCP port
on a Ray node's address)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from heron.config import EngineConfig, KVEventsConfig
from heron.engine.args import EngineArgs


def kv_events_of(engine: EngineConfig | EngineArgs) -> KVEventsConfig:
    return engine.kv_events if isinstance(engine, EngineConfig) else KVEventsConfig.from_dict(engine.kv_events_config)


def rank_kv_events(base: KVEventsConfig, rank: int, private_endpoint: str, host: str | None = None) -> KVEventsConfig:
    """``host``: put a wildcard host (``*``, ``0.0.0.0``) of the user's endpoint on this address."""
    if not base.publishes:
        return KVEventsConfig(True, "zmq", private_endpoint)

    def ranked(address: str) -> str:
        if host is not None:
            for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
                address = address.replace(wildcard, f"tcp://{host}:")
        return port_plus(address, rank)

    return replace(base, endpoint=ranked(base.endpoint),
                   replay_endpoint=None if base.replay_endpoint is None else ranked(base.replay_endpoint))


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
