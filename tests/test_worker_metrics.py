"""A worker's stats become its Prometheus series: counters by delta between heartbeats
(never counting a value twice), gauges as they stand."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from workers.metrics import WorkerMetrics


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_stream_and_export_pool_stats_reach_prometheus():
    m = WorkerMetrics("tiny", "prefill", "r1")
    m.update_from_stats({"stream_generate_calls_total": 3, "stream_prefill_calls_total": 5,
                         "num_stream_rejected": 1, "export_pool_bytes": 64 << 20,
                         "export_buffers_reused_total": 10, "export_buffers_allocated_total": 4})
    m.update_from_stats({"stream_generate_calls_total": 3, "stream_prefill_calls_total": 9,
                         "num_stream_rejected": 1, "export_pool_bytes": 32 << 20,
                         "export_buffers_reused_total": 30, "export_buffers_allocated_total": 4,
                         "export_buffers_fallback_total": 2})
    got = _samples(m)
    model = ("model", "tiny")
    assert got[("pdc_worker_stream_calls_total", (("method", "generate"), model))] == 3
    assert got[("pdc_worker_stream_calls_total", (("method", "prefill"), model))] == 9
    assert got[("pdc_worker_stream_rejected_total", (model,))] == 1
    assert got[("pdc_export_buffers_total", (model, ("outcome", "reused")))] == 30
    assert got[("pdc_export_buffers_total", (model, ("outcome", "allocated")))] == 4
    assert got[("pdc_export_buffers_total", (model, ("outcome", "fallback")))] == 2
    assert got[("pdc_export_pool_bytes", (model, ("pool", "prefill"), ("replica", "r1")))] == 32 << 20


def test_a_decode_replica_shows_no_export_pool_gauge():
    m = WorkerMetrics("tiny", "decode", "r2")
    m.update_from_stats({"kv_blocks_free": 5, "kv_blocks_total": 8})
    assert not any(name == "pdc_export_pool_bytes" for name, _ in _samples(m))


def test_a_decode_replicas_transport_counters_reach_prometheus():
    m = WorkerMetrics("tiny", "decode", "r3")
    m.update_from_stats({"kv_rejections_bad_mac_total": 2, "kv_received_bytes_tcp_total": 100})
    m.update_from_stats({"kv_rejections_bad_mac_total": 3, "kv_rejections_checksum_total": 1,
                         "kv_received_bytes_tcp_total": 400, "kv_received_bytes_shm_total": 50})
    got = _samples(m)
    model = ("model", "tiny")
    assert got[("pdc_kv_transfer_rejections_total", (model, ("reason", "bad_mac")))] == 3
    assert got[("pdc_kv_transfer_rejections_total", (model, ("reason", "checksum")))] == 1
    assert got[("pdc_kv_received_bytes_total", (model, ("path", "tcp")))] == 400
    assert got[("pdc_kv_received_bytes_total", (model, ("path", "shm")))] == 50


def test_preemptions_are_shown_per_replica_from_zero_and_never_go_back():
    m = WorkerMetrics("tiny", "decode", "r4")
    key = ("pdc_num_preemptions_total", (("model", "tiny"), ("pool", "decode"), ("replica", "r4")))
    assert _samples(m)[key] == 0  # before any heartbeat: none is a finding too
    for num_preemptions in (3, 3, 5):
        m.update_from_stats({"num_preemptions": num_preemptions})
    assert _samples(m)[key] == 5
    m.update_from_stats({"num_preemptions": 1})  # a smaller figure never subtracts
    assert _samples(m)[key] == 5


def test_engine_queue_times_are_the_engine_stage_of_the_queue_histogram():
    m = WorkerMetrics("tiny", "prefill", "r5")
    m.observe_engine_queue(0.0)
    m.observe_engine_queue(0.3)
    got = _samples(m)
    labels = (("model", "tiny"), ("stage", "engine"))
    assert got[("pdc_request_queue_seconds_count", labels)] == 2
    assert got[("pdc_request_queue_seconds_sum", labels)] == 0.3
    assert got[("pdc_request_queue_seconds_bucket", (("le", "0.001"), *labels))] == 1


def test_step_seconds_reach_prometheus_by_part():
    m = WorkerMetrics("tiny", "decode", "r5")
    m.update_from_stats({"step_wall_seconds_total": 1.0, "step_cpu_seconds_total": 0.7,
                         "step_run_wait_seconds_total": 0.2})
    m.update_from_stats({"step_wall_seconds_total": 3.0, "step_cpu_seconds_total": 2.0,
                         "step_run_wait_seconds_total": 0.75})
    got = {dict(labels)["part"]: v for (name, labels), v in _samples(m).items()
           if name == "pdc_engine_step_seconds_total" and dict(labels)["pool"] == "decode"}
    assert got == {"wall": 3.0, "cpu": 2.0, "run_wait": 0.75}
