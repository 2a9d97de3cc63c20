"""Every INTERFACES.md metric reaches Prometheus through Ray's own metrics export too.

Real parts only: the session Ray cluster, the real Serve app from `cluster.app:build_app`
on the tiny model, real HTTP traffic (local and disaggregated), then a scrape of every
Ray node's metrics export port — the endpoint KubeRay's PodMonitor scrapes — and of the
ingress `/metrics`. Ray reports application metrics every ~10 s, so the scrape polls.
"""

from __future__ import annotations

import time
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import METRIC_NAMES
from workers.ray_metrics import mirror_into_ray, ray_name

APP, PREFIX = "ray-metrics-test", "/raymetrics"
LABELS = {  # our labels per family, as INTERFACES.md names them
    "pdc_time_to_first_token_seconds": {"model", "route", "workload"},
    "pdc_inter_token_latency_seconds": {"model", "route", "workload"},
    "pdc_e2e_request_latency_seconds": {"model", "route", "workload"},
    "pdc_route_decisions_total": {"model", "route", "reason", "workload"},
    "pdc_kv_transfer_bytes_total": {"model"},
    "pdc_kv_transfer_seconds": {"model", "backend"},
    "pdc_prefix_cache_queries_total": {"model"},
    "pdc_prefix_cache_hits_total": {"model"},
    "pdc_kv_blocks_free": {"model", "pool", "replica"},
    "pdc_kv_blocks_total": {"model", "pool", "replica"},
    "pdc_num_requests_running": {"model", "pool", "replica"},
    "pdc_num_requests_waiting": {"model", "pool", "replica"},
}
SCRAPE_DEADLINE_S = 45.0


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_model_dir):
    from ray import serve

    from cluster.app import build_app

    args = {
        "model": {"path": str(tiny_model_dir), "name": "tiny"},
        "engine": {"num_kv_blocks": 128, "max_num_batched_tokens": 256},
        "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5},
        "router": {"num_cpus": 0.25},
        "transport": {"backend": "zmq", "host": "127.0.0.1"},
    }
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{ray_cluster['http_port']}{PREFIX}"
    serve.delete(APP)


def _send_traffic(url: str) -> None:
    prompt = list(range(20, 120))  # 100 tokens: long enough for a remote prefill
    with httpx.Client(timeout=60) as client:
        _wait_ready(client, url)
        for mode in ("local", "disagg", "disagg"):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            with client.stream("POST", f"{url}/v1/completions", json=body,
                               headers={"x-pd-mode": mode}) as response:
                assert response.status_code == 200, response.read()
                assert "[DONE]" in "".join(response.iter_text())


def _wait_ready(client: httpx.Client, url: str) -> None:
    """Both pools registered (health says ok, not degraded) before traffic starts."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = client.get(f"{url}/health")
        if response.status_code == 200 and response.json().get("status") == "ok":
            return
        time.sleep(0.25)
    raise AssertionError(f"app not healthy: {response.status_code} {response.text}")


def _ray_metric_urls() -> list[str]:
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n["Alive"] and n.get("MetricsExportPort")]


def _families(text: str) -> dict[str, list]:
    """Samples per exposition family name (counters under their `_total` name)."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        out.setdefault(name, []).extend(family.samples)
    return out


def _scrape_ray(wanted: set[str]) -> dict[str, list]:
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        found: dict[str, list] = {}
        for url in _ray_metric_urls():
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            for name, samples in _families(text).items():
                found.setdefault(name, []).extend(samples)
        if wanted <= set(found) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def test_every_interface_metric_is_exported_through_ray(app_url):
    _send_traffic(app_url)
    found = _scrape_ray({ray_name(n) for n in METRIC_NAMES})
    missing = sorted(ray_name(n) for n in METRIC_NAMES if ray_name(n) not in found)
    assert not missing, f"not on Ray's metrics export: {missing}"
    for name in METRIC_NAMES:
        labels = set(found[ray_name(name)][0].labels) - {"le"}
        assert LABELS[name] <= labels, (name, labels)
        assert {"NodeAddress", "SessionName", "WorkerId"} <= labels, (name, labels)
    routes = {s.labels["route"] for s in found["ray_pdc_route_decisions_total"]}
    assert {"local", "disagg"} <= routes
    assert _total(found, "ray_pdc_kv_transfer_bytes_total") > 0
    assert _total(found, "ray_pdc_time_to_first_token_seconds", "_count") >= 3


def test_ingress_metrics_show_the_same_names(app_url):
    text = httpx.get(f"{app_url}/metrics", timeout=30).text
    assert set(METRIC_NAMES) <= set(_families(text))


def test_mirror_is_a_no_op_outside_ray(monkeypatch):
    import ray

    from router.metrics import RouterMetrics

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    metrics = mirror_into_ray(RouterMetrics("m"))
    assert type(metrics.ttft).__name__ == "Histogram"


def _total(found: dict[str, list], family: str, suffix: str = "") -> float:
    return sum(s.value for s in found[family] if s.name == family + suffix or not suffix)
