"""Mirror of the project's Prometheus metrics into Ray's own metrics export.

Each replica records its metrics in its own `prometheus_client` registry (`RouterMetrics`,
`WorkerMetrics`); the ControlPlane sums those on the ingress `/metrics`. A cluster that
already scrapes Ray (KubeRay's PodMonitor on every node's metrics export port) gets the same
facts here too: `mirror_into_ray(owner)` wraps every prometheus_client metric attribute of
`owner` so that each `inc` / `set` / `observe` also goes to a `ray.util.metrics` twin with
the same name, help text, labels and buckets.

What Prometheus sees through Ray (checked against Ray 2.60, OpenTelemetry exporter):

    ingress /metrics                       Ray's metrics export port
    pdc_route_decisions_total{...}         ray_pdc_route_decisions_total{...}
    pdc_time_to_first_token_seconds_bucket ray_pdc_time_to_first_token_seconds_bucket
    pdc_kv_blocks_free{...}                ray_pdc_kv_blocks_free{...}

i.e. `ray_` + the exposition name, our labels unchanged, plus Ray's own labels
(`RAY_EXTRA_LABELS`) on every series — one series per worker process, so queries
aggregate with `sum by (...)` over our labels. `ray_name()` is the one place that rule
lives; the dashboard test checks its queries against it.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.metrics import MetricWrapperBase

RAY_PREFIX = "ray_"
# Labels Ray adds to every application metric series (Ray 2.60).
RAY_EXTRA_LABELS = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId",
                    "otel_scope_name", "otel_scope_schema_url", "otel_scope_version")

_twins: dict[str, Any] = {}  # one ray.util.metrics object per name per process
_lock = threading.Lock()


def ray_name(exposition_name: str) -> str:
    """The name Prometheus sees via Ray for a family/sample name of the ingress `/metrics`."""
    return RAY_PREFIX + exposition_name


def ray_series_names(metric: MetricWrapperBase | MirroredMetric) -> tuple[str, ...]:
    """The sample names Prometheus sees via Ray for one prometheus_client metric."""
    metric = getattr(metric, "metric", metric)
    base = ray_name(metric._name)
    if metric._type == "counter":
        return (base + "_total",)
    if metric._type == "histogram":
        return (base + "_bucket", base + "_sum", base + "_count")
    return (base,)


def mirror_into_ray(owner: object) -> object:
    """Make every prometheus_client metric attribute of `owner` also record into Ray.

    A no-op outside a Ray process (plain unit tests). Returns `owner`; its registry still
    holds the original metrics, so snapshots and `/metrics` are unchanged.
    """
    import ray

    if not ray.is_initialized():
        return owner
    for attr, value in list(vars(owner).items()):
        if isinstance(value, MetricWrapperBase):
            setattr(owner, attr, MirroredMetric(value, _twin(value)))
    return owner


class MirroredMetric:
    """A prometheus_client metric whose labelled children also record into a Ray twin."""

    def __init__(self, metric: MetricWrapperBase, twin: Any) -> None:
        self.metric, self.twin = metric, twin

    def labels(self, *values: Any, **by_name: Any) -> MirroredChild:
        child = self.metric.labels(*values, **by_name)
        names = self.metric._labelnames  # prometheus_client keeps label names only here
        tags = {k: str(v) for k, v in (by_name.items() if by_name else zip(names, values, strict=True))}
        return MirroredChild(child, self.twin, tags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


class MirroredChild:
    """One label set: records locally first, then into Ray (never raises because of Ray)."""

    def __init__(self, child: Any, twin: Any, tags: dict[str, str]) -> None:
        self.child, self.twin, self.tags = child, twin, tags

    def inc(self, amount: float = 1) -> None:
        self.child.inc(amount)
        if hasattr(self.twin, "inc"):
            self._record(self.twin.inc, amount)
        else:  # a Gauge: Ray's has only set(), so send the new value
            self._record(self.twin.set, self.child._value.get())

    def dec(self, amount: float = 1) -> None:
        self.child.dec(amount)
        self._record(self.twin.set, self.child._value.get())

    def set(self, value: float) -> None:
        self.child.set(value)
        self._record(self.twin.set, value)

    def observe(self, value: float) -> None:
        self.child.observe(value)
        self._record(self.twin.observe, value)

    def _record(self, method, value: float) -> None:
        try:
            method(value, tags=self.tags)
        except Exception:  # noqa: BLE001 - metrics export must never fail a request
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.child, name)


def _twin(metric: MetricWrapperBase) -> Any:
    """The process-wide Ray metric matching `metric` (Ray rejects a second definition)."""
    from ray.util import metrics as ray_metrics

    name, kind = metric._name, metric._type  # the name without `_total`; Ray adds it back
    with _lock:
        if name in _twins:
            return _twins[name]
        common = {"description": metric._documentation or name, "tag_keys": tuple(metric._labelnames)}
        if kind == "counter":
            twin = ray_metrics.Counter(name, **common)
        elif kind == "gauge":
            twin = ray_metrics.Gauge(name, **common)
        elif kind == "histogram":
            bounds = [b for b in metric._upper_bounds if b != float("inf")]
            twin = ray_metrics.Histogram(name, boundaries=bounds, **common)
        else:
            raise TypeError(f"cannot mirror a {kind} metric ({name}) into Ray")
        _twins[name] = twin
        return twin
