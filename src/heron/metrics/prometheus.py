"""Prometheus metrics named like vLLM's, with the ``heron:`` prefix, so existing
dashboards and alerts carry over. Each server owns its registry (no globals).

Several API-server processes (``heron serve --api-server-count M``) run in
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the
launcher before they start): request metrics add up across the processes, and
the engines' own figures (running and waiting requests, KV usage, prefix-cache
and preemption counters), which every API server receives, are recorded by
one of them only, so nothing is counted M times. Any process's /metrics
answers for the whole server."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from heron.metrics.stats import IterationStats
from heron.step_outputs import SchedulerStats

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]

# every metric name this module exports (the dashboard test checks against it)
EXPORTED_METRICS = (
    "heron:num_requests_running", "heron:num_requests_waiting", "heron:kv_cache_usage_perc",
    "heron:prompt_tokens_total", "heron:generation_tokens_total", "heron:request_success_total",
    "heron:num_preemptions_total", "heron:prefix_cache_queries_total", "heron:prefix_cache_hits_total",
    "heron:time_to_first_token_seconds", "heron:inter_token_latency_seconds",
    "heron:request_time_per_output_token_seconds", "heron:e2e_request_latency_seconds",
    "heron:request_queue_time_seconds", "heron:request_prefill_time_seconds",
    "heron:request_decode_time_seconds", "heron:request_inference_time_seconds",
    "heron:request_prompt_tokens", "heron:request_generation_tokens", "heron:iteration_tokens_total",
    "heron:spec_decode_num_drafts_total", "heron:spec_decode_num_draft_tokens_total",
    "heron:spec_decode_num_accepted_tokens_total", "heron:compute_path_info",
    "heron:kv_offload_stored_blocks_total", "heron:kv_offload_loaded_blocks_total",
    "heron:kv_offload_evicted_blocks_total", "heron:kv_offload_hit_tokens_total", "heron:kv_offload_blocks",
    "heron:kv_offload_bytes", "heron:kv_offload_load_failures_total", "heron:request_aborts_total",
)
# why the API server ended a request early (heron:request_aborts_total's label)
REQUEST_ABORT_REASONS = ("client_disconnected", "request_timeout", "stream_stalled")
_OFFLOAD_TIERS = ("host", "disk")


def multiprocess_dir() -> str | None:
    """Where the API-server processes of one server keep their metrics, if several share them."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 record_engine_stats: bool = True) -> None:
        """``record_engine_stats``: record the engines' scheduler statistics (one
        API server of several does)."""
        self.registry = registry or CollectorRegistry()
        self.record_engine_stats = record_engine_stats
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            # one API server sets these; the others' zeros never win the max
            return Gauge(f"heron:{name}", doc, labels, registry=r, multiprocess_mode="livemax")

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"heron:{name}", doc, labels + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"heron:{name}", doc, labels, buckets=buckets, registry=r)

        self.engine_requests: Gauge | None = None  # with data parallelism only
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter("request_success", "Finished requests", ["finished_reason"])
        self.request_aborts = counter("request_aborts", "HTTP requests the server ended early, by reason", ["reason"])
        self.preemptions = counter("num_preemptions", "Preemptions")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications (request-steps with drafts)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        # the KV offload tiers (tier="host" | "disk"), from SchedulerStats.kv_<tier>_<field>
        self.offload_counters = {
            field: Counter(f"heron:kv_offload_{name}", doc, labels + ["tier"], registry=r)
            for field, name, doc in (
                ("stored", "stored_blocks", "Blocks saved to the offload tier"),
                ("loaded", "loaded_blocks", "Blocks loaded back from the offload tier"),
                ("evicted", "evicted_blocks", "Blocks the offload tier dropped for room"),
                ("hit_tokens", "hit_tokens", "Prompt tokens found in the offload tier"),
                ("load_failures", "load_failures", "Blocks the offload tier could not deliver (missing, corrupt)"),
            )
        }
        self.offload_gauges = {
            field: Gauge(f"heron:kv_offload_{field}", doc, labels + ["tier"], registry=r, multiprocess_mode="livemax")
            for field, doc in (("blocks", "Blocks the offload tier holds"),
                               ("bytes", "Bytes the offload tier holds"))
        }
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens", _LATENCY_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean decode time per output token", _LATENCY_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Queued to first scheduled", _REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token", _REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token", _REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens scheduled per engine step", _TOKEN_BUCKETS)
        # what each step runs (labels: worker/compute_path.py), set once the engine is ready
        self.compute_path: Gauge | None = None
        self.model_name = model_name
        self._last_cumulative = SchedulerStats()
        self._show_series_at_zero()

    def _show_series_at_zero(self) -> None:
        """Every series without a further label (and the abort reasons') shows, at 0,
        from the start: a dashboard or an alert on a rate found no series on a
        server that had served nothing yet."""
        name = self.model_name
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(name).set(0)
        for reason in REQUEST_ABORT_REASONS:
            self.request_aborts.labels(name, reason)
        for series in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens,
                       self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                       self.inference_time, self.request_prompt_tokens, self.request_generation_tokens,
                       self.iteration_tokens):
            series.labels(name)

    def count_request_abort(self, reason: str) -> None:
        """One HTTP request the server ended early (``REQUEST_ABORT_REASONS``)."""
        self.request_aborts.labels(self.model_name, reason).inc()

    def _record_offload(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        for tier in _OFFLOAD_TIERS:
            if not any(getattr(figures, f"kv_{tier}_{field}") for figures in (stats, last)
                       for field in ("stored", "blocks")):
                continue  # no such tier, or nothing in it yet (a tier emptied by a reset: its gauges go to 0)
            for field, counter_metric in self.offload_counters.items():
                delta = getattr(stats, f"kv_{tier}_{field}", 0) - getattr(last, f"kv_{tier}_{field}", 0)
                counter_metric.labels(self.model_name, tier).inc(max(delta, 0))  # a zero still shows the series
            for field, gauge in self.offload_gauges.items():
                value, before = getattr(stats, f"kv_{tier}_{field}"), getattr(last, f"kv_{tier}_{field}")
                if value or before:
                    gauge.labels(self.model_name, tier).set(value)

    def set_engine_requests(self, counts: Sequence[int]) -> None:
        """Requests placed on each engine core (data parallelism), so far."""
        if self.engine_requests is None:
            self.engine_requests = Gauge("heron:engine_requests", "Requests placed on each engine core so far",
                                         ["model_name", "engine"], registry=self.registry,
                                         multiprocess_mode="livesum")
        for rank, count in enumerate(counts):
            self.engine_requests.labels(self.model_name, str(rank)).set(count)

    def set_compute_path(self, path: dict[str, str]) -> None:
        """``heron:compute_path_info``: 1, with the path as labels (an info gauge)."""
        labels = {key: str(value) for key, value in path.items() if key != "model_name"}
        labels["model_name"] = self.model_name
        if self.compute_path is not None and set(self.compute_path._labelnames) != set(labels):
            self.registry.unregister(self.compute_path)
            self.compute_path = None
        if self.compute_path is None:
            self.compute_path = Gauge("heron:compute_path_info",
                                      "The engine's compute path: device, dtype, kernels, decode path",
                                      sorted(labels), registry=self.registry, multiprocess_mode="livemax")
        self.compute_path.labels(**labels).set(1)

    def engine_gone(self) -> None:
        """The engine core is dead: it runs and holds nothing any more (the gauges
        kept its last step's figures, a dead server reporting requests running)."""
        if self.record_engine_stats:
            for gauge in (self.running, self.waiting, self.kv_usage):
                gauge.labels(self.model_name).set(0)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None) -> None:
        name = self.model_name
        if scheduler_stats is not None and self.record_engine_stats:
            self.running.labels(name).set(scheduler_stats.num_running_reqs)
            self.waiting.labels(name).set(scheduler_stats.num_waiting_reqs)
            self.kv_usage.labels(name).set(scheduler_stats.kv_cache_usage)
            last = self._last_cumulative
            self.preemptions.labels(name).inc(max(0, scheduler_stats.num_preemptions - last.num_preemptions))
            self.prefix_queries.labels(name).inc(
                max(0, scheduler_stats.prefix_cache_queries - last.prefix_cache_queries)
            )
            self.prefix_hits.labels(name).inc(max(0, scheduler_stats.prefix_cache_hits - last.prefix_cache_hits))
            self.spec_drafts.labels(name).inc(max(0, scheduler_stats.spec_num_drafts - last.spec_num_drafts))
            self.spec_draft_tokens.labels(name).inc(
                max(0, scheduler_stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
            )
            self.spec_accepted_tokens.labels(name).inc(
                max(0, scheduler_stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
            )
            self._record_offload(scheduler_stats, last)
            for step_tokens in (scheduler_stats.earlier_step_tokens, scheduler_stats.num_scheduled_tokens):
                if step_tokens:
                    self.iteration_tokens.labels(name).observe(step_tokens)
            self._last_cumulative = scheduler_stats
        if iteration is None:
            return
        self.prompt_tokens.labels(name).inc(iteration.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(iteration.num_generation_tokens)
        if iteration.time_to_first_tokens:
            ttft = self.ttft.labels(name)
            for value in iteration.time_to_first_tokens:
                ttft.observe(value)
        if iteration.inter_token_latencies:  # one per streamed token: look the child up once
            itl = self.itl.labels(name)
            for value in iteration.inter_token_latencies:
                itl.observe(value)
        for finished in iteration.finished_requests:
            self.request_success.labels(name, finished.finish_reason).inc()
            self.e2e.labels(name).observe(finished.e2e_latency)
            self.queue_time.labels(name).observe(finished.queue_time)
            self.prefill_time.labels(name).observe(finished.prefill_time)
            self.decode_time.labels(name).observe(finished.decode_time)
            self.inference_time.labels(name).observe(finished.inference_time)
            self.request_prompt_tokens.labels(name).observe(finished.num_prompt_tokens)
            self.request_generation_tokens.labels(name).observe(finished.num_generation_tokens)
            if finished.mean_time_per_output_token is not None:
                self.tpot.labels(name).observe(finished.mean_time_per_output_token)

    def render(self, names: Collection[str] = ()) -> bytes:
        """The exposition text; only the samples named in ``names`` when given
        (``/metrics?name[]=...``, as prometheus_client's own handler: a router
        probing three gauges need not have every histogram rendered)."""
        directory = multiprocess_dir()
        registry = self.registry
        if directory is not None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, directory)
        return generate_latest(_Named(registry, set(names)) if names else registry)


class _Named:
    """A registry's samples whose names are in ``names`` (works in multiprocess
    mode too, where ``restricted_registry`` sees no names)."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            samples = [sample for sample in metric.samples if sample.name in self.names]
            if samples:
                named = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                named.samples = samples
                yield named
