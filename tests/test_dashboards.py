"""The Grafana dashboard (manifests/dashboards/pdcluster.json) queries only metric names
and labels the code emits, as exported via Ray, and covers every INTERFACES.md metric."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"

PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile",
                "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "topk", "bottomk", "clamp_min", "clamp_max", "label_values", "abs", "delta", "deriv"}


@cache
def emitted() -> dict[str, set[str]]:
    """Every sample name the code's metrics show through Ray, with the metric's labels."""
    from prometheus_client.metrics import MetricWrapperBase

    from router.metrics import RouterMetrics
    from workers.metrics import WorkerMetrics
    from workers.ray_metrics import MirroredMetric, ray_series_names

    names: dict[str, set[str]] = {}
    for owner in (RouterMetrics("m"), WorkerMetrics("m", "decode", "r")):
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase | MirroredMetric):
                labels = set(getattr(metric, "metric", metric)._labelnames)
                for name in ray_series_names(metric):
                    names[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads((MANIFESTS / "dashboards" / "pdcluster.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert queries
    return queries


def metric_names_in(query: str) -> set[str]:
    text = re.sub(r'"[^"]*"', "", query)                    # label values, strings
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)        # matchers, ranges
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", text)
    return {w for w in re.findall(r"(?<![$\w.])[A-Za-z_:][\w:]*", text) if w not in PROMQL_WORDS}


def grouping_labels_in(query: str) -> set[str]:
    groups_ = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query)
    matchers = re.findall(r"\{([^}]*)\}", query)
    labels = {label.strip() for g in groups_ for label in g.split(",")}
    labels |= {m.group(1) for block in matchers for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", block)}
    return labels


@pytest.mark.parametrize("query", dashboard_queries())
def test_dashboard_query_names_only_metrics_the_code_emits_via_ray(query):
    names = metric_names_in(query)
    assert names, query
    unknown = names - set(emitted())
    assert not unknown, f"not emitted via Ray: {sorted(unknown)} in {query}"
    allowed = set().union(*(emitted()[n] for n in names))
    assert grouping_labels_in(query) <= allowed, query
    if "histogram_quantile(" in query:
        assert "_bucket" in query and "le" in grouping_labels_in(query), query


def test_dashboard_covers_every_interface_metric():
    from router.metrics import METRIC_NAMES
    from workers.ray_metrics import ray_name

    used = set().union(*(metric_names_in(q) for q in dashboard_queries()))
    for name in METRIC_NAMES:
        assert any(u == ray_name(name) or u.startswith(ray_name(name) + "_") for u in used), name
