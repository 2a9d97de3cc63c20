"""`/health` and routing when worker pools never come up: apps whose prefill pool, then
every worker pool, is pinned to a Ray resource no node has. Degraded (local prefill,
reason `prefill-unhealthy`) without prefill replicas, 503 without any worker. Runs after
tests/router_http/ has deleted its app, which serves the same route prefix."""

from __future__ import annotations

import httpx
import pytest

from tests.router_http.support import (
    NOWHERE,
    TOKEN,
    app_config,
    assert_openai_error,
    complete,
    wait_health,
)


@pytest.fixture()
def unplaced_app(ray_cluster, tiny_model_dir, tmp_path):
    """Deploys an app whose chosen pools can never be placed; yields (client, deploy)."""
    from ray import serve

    from cluster.app import build_app

    token = tmp_path / "admin"
    token.write_text(TOKEN)
    names = []

    def deploy(name, **overrides):
        config = app_config(tiny_model_dir, token, router={"num_replicas": 1, "num_cpus": 0}, **overrides)
        serve._run(build_app(config), _blocking=False, name=name, route_prefix="/")
        names.append(name)

    with httpx.Client(base_url=f"http://127.0.0.1:{ray_cluster['http_port']}", timeout=60) as c:
        yield c, deploy
    for name in names:
        serve.delete(name)


def test_health_degraded_without_prefill_then_503_without_any(unplaced_app):
    from ray import serve

    client, deploy = unplaced_app
    deploy("pdc-no-prefill", prefill=NOWHERE)
    r = wait_health(client, lambda r: r.status_code == 200)
    assert r.json()["status"] == "degraded"
    assert r.json()["pools"]["prefill"]["status"] == "down"
    done = complete(client, "a long prompt that wants a prefill replica " * 2, headers={"x-pd-mode": "disagg"})
    assert done.status_code == 200
    assert (done.headers["x-pd-route"], done.headers["x-pd-reason"]) == ("local", "prefill-unhealthy")
    serve.delete("pdc-no-prefill")

    deploy("pdc-no-workers", prefill=NOWHERE, decode=NOWHERE)
    r = wait_health(client, lambda r: r.status_code == 503 and "error" not in r.json())
    assert r.json()["status"] == "unavailable"
    assert_openai_error(complete(client), 503)
