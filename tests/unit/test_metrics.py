"""Metrics: the Prometheus exporter, the periodic log line, and the Grafana
dashboard only querying metrics heron exports."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from heron.metrics.logging_stats import LoggingStatLogger
from heron.metrics.prometheus import EXPORTED_METRICS, PrometheusStatLogger
from heron.metrics.stats import IterationStats, RequestTimes
from heron.step_outputs import EngineEventType, SchedulerStats

ROOT = pathlib.Path(__file__).resolve().parents[2]


def sample_names(logger: PrometheusStatLogger) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(logger.render().decode()):
        names.update(sample.name for sample in family.samples)
    return names


def one_finished_iteration() -> IterationStats:
    stats = IterationStats()
    times = RequestTimes(arrival=0.0, queued=0.1, scheduled=0.2)
    stats.observe_tokens(times, num_prompt_tokens=12, num_new_tokens=1, now=0.5)
    stats.observe_tokens(times, num_prompt_tokens=12, num_new_tokens=1, now=0.6)
    stats.observe_finished(times, "length", 12, 2, now=0.6)
    return stats


def test_spans_are_taken_within_one_clock_when_the_engine_runs_on_another_machine():
    """An engine core on another machine (Ray) stamps its events with a monotonic
    clock of another origin: TTFT and end-to-end latency were the front end's
    arrival subtracted from the engine's step time (-3599.9 s, an hour off)."""
    offset = -3600.0  # the engine's clock reads an hour behind the front end's
    stats = IterationStats()
    times = RequestTimes(arrival=10.0)
    times.apply_events([(EngineEventType.QUEUED, 10.01 + offset), (EngineEventType.SCHEDULED, 10.03 + offset)])
    stats.observe_tokens(times, 12, 1, now=10.5, engine_now=10.45 + offset)
    stats.observe_tokens(times, 12, 1, now=10.62, engine_now=10.55 + offset)
    stats.observe_finished(times, "length", 12, 2, now=10.62, engine_now=10.55 + offset)
    assert stats.time_to_first_tokens == [pytest.approx(0.5)]  # the front end's clock: what a client sees
    assert stats.inter_token_latencies == [pytest.approx(0.1)]  # the engine's: between its own steps
    [done] = stats.finished_requests
    assert done.e2e_latency == pytest.approx(0.62)
    assert (done.queue_time, done.prefill_time, done.decode_time) == pytest.approx((0.02, 0.42, 0.1))
    # aborted in the front end (no engine time): the engine's spans end at its last event
    aborted = IterationStats()
    times = RequestTimes(arrival=10.0)
    times.apply_events([(EngineEventType.QUEUED, 10.01 + offset), (EngineEventType.SCHEDULED, 10.03 + offset)])
    aborted.observe_finished(times, "abort", 12, 0, now=11.0)
    [done] = aborted.finished_requests
    assert done.e2e_latency == pytest.approx(1.0) and done.queue_time == pytest.approx(0.02)
    assert done.prefill_time == 0.0 and done.inference_time == 0.0


def test_exporter_records_everything_it_declares():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=100,
                                 prefix_cache_hits=40, num_preemptions=3, num_scheduled_tokens=17,
                                 earlier_step_tokens=5,
                                 spec_num_drafts=5, spec_num_draft_tokens=20, spec_num_accepted_tokens=11,
                                 kv_host_stored=7, kv_host_loaded=4, kv_host_evicted=1,
                                 kv_host_hit_tokens=64, kv_host_blocks=6, kv_host_bytes=6144,
                                 kv_disk_stored=9, kv_disk_loaded=3, kv_disk_load_failures=2, kv_disk_blocks=9,
                                 kv_disk_bytes=9300),
                  one_finished_iteration())
    text = logger.render().decode()
    values = {s.name + str(sorted(s.labels.items())): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["heron:num_requests_running[('model_name', 'm')]"] == 2
    assert values["heron:kv_cache_usage_perc[('model_name', 'm')]"] == 0.25
    assert values["heron:prefix_cache_hits_total[('model_name', 'm')]"] == 40
    assert values["heron:num_preemptions_total[('model_name', 'm')]"] == 3
    assert values["heron:iteration_tokens_total_count[('model_name', 'm')]"] == 2  # two steps in one message
    assert values["heron:iteration_tokens_total_sum[('model_name', 'm')]"] == 22
    assert values["heron:spec_decode_num_drafts_total[('model_name', 'm')]"] == 5
    assert values["heron:spec_decode_num_draft_tokens_total[('model_name', 'm')]"] == 20
    assert values["heron:spec_decode_num_accepted_tokens_total[('model_name', 'm')]"] == 11
    assert values["heron:kv_offload_loaded_blocks_total[('model_name', 'm'), ('tier', 'host')]"] == 4
    assert values["heron:kv_offload_hit_tokens_total[('model_name', 'm'), ('tier', 'host')]"] == 64
    assert values["heron:kv_offload_blocks[('model_name', 'm'), ('tier', 'host')]"] == 6
    assert values["heron:kv_offload_bytes[('model_name', 'm'), ('tier', 'host')]"] == 6144
    assert values["heron:kv_offload_stored_blocks_total[('model_name', 'm'), ('tier', 'disk')]"] == 9
    assert values["heron:kv_offload_load_failures_total[('model_name', 'm'), ('tier', 'disk')]"] == 2
    assert values["heron:kv_offload_bytes[('model_name', 'm'), ('tier', 'disk')]"] == 9300
    assert values["heron:prompt_tokens_total[('model_name', 'm')]"] == 12
    assert values["heron:generation_tokens_total[('model_name', 'm')]"] == 2
    assert values["heron:request_success_total[('finished_reason', 'length'), ('model_name', 'm')]"] == 1
    assert values["heron:time_to_first_token_seconds_sum[('model_name', 'm')]"] == 0.5
    assert values["heron:inter_token_latency_seconds_count[('model_name', 'm')]"] == 1
    assert abs(values["heron:request_queue_time_seconds_sum[('model_name', 'm')]"] - 0.1) < 1e-9
    logger.set_compute_path({"device": "cpu", "cpu_isa": "avx2", "decode": "native (one C call per step)"})
    assert ('heron:compute_path_info{cpu_isa="avx2",decode="native (one C call per step)",device="cpu",'
            'model_name="m"} 1.0') in logger.render().decode()
    names = sample_names(logger)
    for metric in EXPORTED_METRICS:
        assert any(name.startswith(metric) for name in names), metric
    # cumulative engine counters become deltas: a second report adds only the difference
    logger.record(SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=60, num_preemptions=3), None)
    text = logger.render().decode()
    assert 'heron:prefix_cache_hits_total{model_name="m"} 60.0' in text


def test_periodic_log_line():
    logger = LoggingStatLogger(interval_s=10.0)
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5,
                                 prefix_cache_queries=200, prefix_cache_hits=50), one_finished_iteration())
    assert logger.maybe_log(now=logger._window_start + 1.0) is None  # interval not reached
    line = logger.maybe_log(now=logger._window_start + 10.0)
    assert line is not None
    assert "Avg prompt throughput: 1.2 tokens/s" in line and "Avg generation throughput: 0.2 tokens/s" in line
    assert "Running: 3 reqs" in line and "Waiting: 1 reqs" in line
    assert "KV cache usage: 50.0%" in line and "Prefix cache hit rate: 25.0%" in line
    assert "Spec" not in line  # no speculative decoding: no acceptance figures
    # one of several API servers counts its own requests' tokens, and says so (two lines 3 s apart read 3.2 and
    # 0.0 tokens/s for one server)
    scoped = LoggingStatLogger(interval_s=10.0, scope="API server 2 of 2 (its requests)")
    scoped.record(None, one_finished_iteration())
    line = scoped.maybe_log(now=scoped._window_start + 10.0)
    assert line is not None and line.startswith("API server 2 of 2 (its requests): Avg prompt throughput")


def test_periodic_log_line_reports_spec_acceptance():
    logger = LoggingStatLogger(interval_s=10.0)
    logger.record(SchedulerStats(num_running_reqs=1, spec_num_drafts=4, spec_num_draft_tokens=16,
                                 spec_num_accepted_tokens=10), None)
    logger.record(SchedulerStats(num_running_reqs=1, spec_num_drafts=8, spec_num_draft_tokens=32,
                                 spec_num_accepted_tokens=20), None)
    line = logger.maybe_log(now=logger._window_start + 10.0)
    assert line is not None
    assert "Spec acceptance rate: 62.5%" in line and "Mean acceptance length: 3.50" in line


def test_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((ROOT / "observability" / "grafana-dashboard.json").read_text())
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(num_scheduled_tokens=1), one_finished_iteration())
    exported = sample_names(logger)
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"heron:[a-z0-9_]+", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        queried.update(re.findall(r"heron:[a-z0-9_]+", str(variable.get("query", ""))))
    missing = sorted(name for name in queried if name not in exported)
    assert not missing, f"dashboard queries metrics heron does not export: {missing}"
    # the dashboard covers latency, throughput, KV usage, queue, cache hit rate and preemptions
    for needed in ("heron:time_to_first_token_seconds_bucket", "heron:generation_tokens_total",
                   "heron:kv_cache_usage_perc", "heron:num_requests_waiting", "heron:prefix_cache_hits_total",
                   "heron:num_preemptions_total"):
        assert needed in queried


def test_prometheus_scrape_example_points_at_metrics():
    text = (ROOT / "observability" / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in text and "job_name: heron" in text


def test_render_keeps_only_the_samples_asked_for():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=3), one_finished_iteration())
    wanted = ["heron:num_requests_waiting", "heron:time_to_first_token_seconds_count"]
    families = list(text_string_to_metric_families(logger.render(wanted).decode()))
    samples = {sample.name: sample.value for family in families for sample in family.samples}
    assert samples == {"heron:num_requests_waiting": 3, "heron:time_to_first_token_seconds_count": 1}
    assert sample_names(logger) > set(samples)  # no names: everything


def test_an_idle_server_shows_its_series_at_zero():
    """A server that had served nothing showed no sample of its counters and
    histograms: a dashboard's rate, or an alert on one, found no series."""
    text = PrometheusStatLogger("m").render().decode()
    for line in ('heron:prompt_tokens_total{model_name="m"} 0.0', 'heron:num_preemptions_total{model_name="m"} 0.0',
                 'heron:prefix_cache_hits_total{model_name="m"} 0.0',
                 'heron:time_to_first_token_seconds_count{model_name="m"} 0.0',
                 'heron:e2e_request_latency_seconds_count{model_name="m"} 0.0'):
        assert line in text.splitlines(), line
