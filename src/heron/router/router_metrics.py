"""The router's own Prometheus metrics (``heron router``'s /metrics adds the
replicas' states as gauges at each scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("heron_router_requests", "Requests sent to a replica", ["replica", "reason"],
                                registry=self.registry)
        self.retries = Counter("heron_router_retries", "Requests retried on another replica before their first byte",
                               registry=self.registry)
        self.failed = Counter("heron_router_failed_requests", "Requests no replica could serve", registry=self.registry)
        self.cut_streams = Counter(
            "heron_router_cut_streams", "Streams cut by a failing replica", registry=self.registry
        )
        self.timeouts = Counter("heron_router_timeouts", "Requests that ran past --request-timeout",
                                registry=self.registry)
        self.matched_blocks = Counter(
            "heron_router_matched_blocks", "Prompt blocks found cached on the chosen replica", registry=self.registry
        )
        self.prompt_blocks = Counter("heron_router_prompt_blocks", "Prompt blocks routed", registry=self.registry)
        self.decision_seconds = Histogram("heron_router_decision_seconds", "Hashing and choosing a replica",
                                          buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
                                          registry=self.registry)
        self.in_flight = Gauge("heron_router_in_flight", "Requests under way per replica", ["replica"],
                               registry=self.registry)
        self.usable = Gauge("heron_router_replica_usable", "1 while a replica's circuit is not open", ["replica"],
                            registry=self.registry)
