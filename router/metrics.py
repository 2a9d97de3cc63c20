"""The metrics of INTERFACES.md, and how they travel and add up across replicas.

Each replica keeps its own `prometheus_client` registry (`RouterMetrics` here for routers,
`workers.metrics.WorkerMetrics` for workers) and ships it to the ControlPlane, either as
`snapshot(registry)` (plain lists and dicts) or as Prometheus text (`from_text` reads
it back); the ControlPlane serves
`render(merge(snapshots))` on `/metrics`: counters and histograms summed per label set,
gauges kept apart by their `pool`/`replica` labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from workers.metrics import LATENCY_BUCKETS, QUEUE_HELP, QUEUE_SECONDS
from workers.ray_metrics import mirror_into_ray

ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)  # |predicted - measured| / measured
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_LABELS = ("model", "route", "workload")
REPLICA_LABELS = ("model", "pool", "replica")

# Every name `/metrics` shows, as Prometheus spells it (counters carry `_total`).
METRIC_NAMES = (
    "pdc_time_to_first_token_seconds", "pdc_inter_token_latency_seconds",
    "pdc_e2e_request_latency_seconds", "pdc_route_decisions_total",
    "pdc_kv_transfer_bytes_total", "pdc_kv_transfer_seconds",
    "pdc_prefix_cache_queries_total", "pdc_prefix_cache_hits_total",
    "pdc_kv_blocks_free", "pdc_kv_blocks_total",
    "pdc_num_requests_running", "pdc_num_requests_waiting",
)
# Names for diagnosing latency and refusals. Not in METRIC_NAMES, which every cluster shows
# after ordinary traffic: the counters of 429s and timeouts have no series before the first
# one, and the engine queue and preemptions appear once a worker has heartbeated.
DIAGNOSIS_METRIC_NAMES = (
    "pdc_num_preemptions_total", "pdc_request_queue_seconds",
    "pdc_requests_rejected_total", "pdc_request_timeouts_total",
)

Snapshot = list[dict[str, Any]]


class RouterMetrics:
    """Recorded by the Router ingress, per request."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("pdc_time_to_first_token_seconds", "Request arrival to first generated token.",
                              REQUEST_LABELS, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdc_inter_token_latency_seconds", "Gap between successive streamed tokens.",
                             REQUEST_LABELS, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdc_e2e_request_latency_seconds", "Request arrival to last token.",
                             REQUEST_LABELS, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.route_decisions = Counter("pdc_route_decisions", "Routes taken, by reason.",
                                       ("model", "route", "reason", "workload"), registry=self.registry)
        self.worker_calls = Counter("pdc_worker_calls", "Calls to worker replicas, by how they travelled "
                                    "(stream: the ZeroMQ worker stream; handle: a Serve handle).",
                                    ("model", "path"), registry=self.registry)
        self.prediction_error = Histogram(
            "pdc_prediction_abs_pct_error", "The routing policy's prediction error per finished request: "
            "|predicted - measured| / measured, router-side TTFT and TPOT, for the route taken.",
            ("model", "route", "metric"), registry=self.registry, buckets=ERROR_BUCKETS)
        self.correction_factor = Gauge(
            "pdc_policy_correction_factor", "Measured / predicted, smoothed, that this router replica "
            "applies to predictions (1: the step model alone).",
            ("model", "router", "replica", "route", "metric"), registry=self.registry)
        self.admission_queue = Histogram(QUEUE_SECONDS, QUEUE_HELP, ("model", "stage"),
                                         registry=self.registry, buckets=LATENCY_BUCKETS)
        self.rejected = Counter(
            "pdc_requests_rejected", "429s the router answered, by tenant (`anonymous` without a keys "
            "file) and code (rate_limit_exceeded, concurrency_limit_exceeded, server_overloaded)",
            ("model", "tenant", "code"), registry=self.registry)
        self.timeouts = Counter(
            "pdc_request_timeouts", "Admitted requests a time limit ended (the workload's deadline_s, "
            "or no first chunk within router.request_timeout_s), whatever the client received",
            ("model", "tenant", "workload"), registry=self.registry)
        mirror_into_ray(self)  # the same recordings also reach Ray's Prometheus export

    def observe_admission_wait(self, seconds: float) -> None:
        self.admission_queue.labels(self.model, "admission").observe(seconds)

    def record_rejected(self, tenant: str, code: str) -> None:
        self.rejected.labels(self.model, tenant, code).inc()

    def record_timeout(self, tenant: str, workload: str) -> None:
        self.timeouts.labels(self.model, tenant, workload).inc()

    def record_route(self, route: str, reason: str, workload: str) -> None:
        self.route_decisions.labels(self.model, route, reason, workload).inc()

    def record_worker_call(self, path: str) -> None:
        self.worker_calls.labels(self.model, path).inc()

    def observe_prediction(self, route: str, metric: str, predicted: float, measured: float) -> None:
        if measured > 0:
            self.prediction_error.labels(self.model, route, metric).observe(abs(predicted - measured) / measured)

    def set_correction(self, router: str, replica: str, route: str, metric: str, factor: float) -> None:
        self.correction_factor.labels(self.model, router, replica, route, metric).set(factor)

    def observe_ttft(self, route: str, workload: str, seconds: float) -> None:
        self.ttft.labels(self.model, route, workload).observe(seconds)

    def observe_itl(self, route: str, workload: str, seconds: float) -> None:
        self.itl.labels(self.model, route, workload).observe(seconds)

    def observe_e2e(self, route: str, workload: str, seconds: float) -> None:
        self.e2e.labels(self.model, route, workload).observe(seconds)


def snapshot(registry: CollectorRegistry) -> Snapshot:
    """The registry's current values as plain data (no `_created` series)."""
    families = []
    for family in registry.collect():
        samples = [[s.name, dict(s.labels), float(s.value)] for s in family.samples
                   if not s.name.endswith("_created")]
        families.append({"name": family.name, "type": family.type,
                         "help": family.documentation, "samples": samples})
    return families


def from_text(text: str | bytes) -> Snapshot:
    """A snapshot from Prometheus text exposition (what `generate_latest` wrote)."""
    if isinstance(text, bytes):
        text = text.decode()
    families = []
    for family in text_string_to_metric_families(text):
        samples = [[s.name, dict(s.labels), float(s.value)] for s in family.samples
                   if not s.name.endswith("_created")]
        families.append({"name": family.name, "type": family.type,
                         "help": family.documentation, "samples": samples})
    return families


def as_snapshot(data: Snapshot | str | bytes | None) -> Snapshot:
    if data is None:
        return []
    return from_text(data) if isinstance(data, (str, bytes)) else data


def merge(snapshots: Iterable[Snapshot]) -> Snapshot:
    """One snapshot: counters/histograms summed per label set, gauges last-writer-wins
    per label set (their `replica` label keeps replicas apart)."""
    merged: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[tuple, list]] = {}
    for snap in snapshots:
        for family in snap or ():
            name = family["name"]
            merged.setdefault(name, {k: family[k] for k in ("name", "type", "help")})
            series = values.setdefault(name, {})
            for sample_name, labels, value in family["samples"]:
                key = (sample_name, tuple(sorted(labels.items())))
                if key in series and family["type"] != "gauge":
                    series[key][2] += value
                else:
                    series[key] = [sample_name, dict(labels), value]
    return [{**merged[name], "samples": list(values[name].values())} for name in sorted(merged)]


def render(families: Snapshot) -> bytes:
    """Prometheus text exposition of a (merged) snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Replay(families))
    return generate_latest(registry)


class _Replay:
    def __init__(self, families: Snapshot) -> None:
        self.families = families

    def collect(self):
        for family in self.families:
            metric = Metric(family["name"], family["help"], family["type"])
            for sample_name, labels, value in family["samples"]:
                metric.add_sample(sample_name, labels, value)
            yield metric
