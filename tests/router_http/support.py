"""The Router's HTTP API end to end, shared by this package's test modules: the app's
config, the app itself (1 prefill + 1 decode + 2 router replicas on real Ray Serve,
deployed once for the package: tests/router_http/conftest.py), and helpers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx

APP = "pdc-router-http"
TOKEN = "admin-secret-token"
NOWHERE = {"resources": {"pdc_test_no_such_node": 1.0}}
DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT = 4, 96  # a bounded JSON object needs a few dozen tokens


def app_config(model_dir, token_file, **overrides):
    config = {
        "model": {"path": str(model_dir)},
        "engine": {"num_kv_blocks": 512, "max_num_seqs": 16},
        "transport": {"host": "127.0.0.1"},
        "router": {"num_replicas": 2, "num_cpus": 0},
        "secrets": {"admin_token_file": str(token_file)},
        "limits": {"default_max_tokens": DEFAULT_MAX_TOKENS, "max_tokens_limit": MAX_TOKENS_LIMIT},
        "workloads": {
            "default": {"mode": "threshold", "min_remote_prefill_tokens": 32},
            "locked": {"mode": "local", "allow_client_override": False},
            "rag": {"mode": "disagg"},
        },
    }
    config.update(overrides)
    return config


def wait_health(client, ok, timeout_s=120.0, times=1):
    """`times` answers in a row: with two router replicas, one replica's view may lag."""
    deadline, streak = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            r = client.get("/health")
            streak = streak + 1 if ok(r) else 0
            if streak >= times:
                return r
        except httpx.HTTPError:
            streak = 0
        time.sleep(0.3)
    raise AssertionError(f"/health never reached the expected state: {r.status_code} {r.text}")



def serve_router_app(ray_cluster, model_dir, tmp_path_factory, name: str = APP) -> Iterator[httpx.Client]:
    """Deploys the app, waits until every router replica answers healthy, yields a client
    and deletes the app afterwards (the body of the package's `client` fixture)."""
    from ray import serve

    from cluster.app import build_app

    token_file = tmp_path_factory.mktemp("secrets") / "admin"
    token_file.write_text(TOKEN)
    serve.run(build_app(app_config(model_dir, token_file)), name=name, route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{ray_cluster['http_port']}", timeout=60) as c:
        wait_health(c, lambda r: r.status_code == 200 and r.json()["status"] == "ok", times=6)
        yield c
    serve.delete(name)


def complete(client, prompt="hello there", headers=None, **body):
    body = {"prompt": prompt, "temperature": 0, **body}
    return client.post("/v1/completions", json=body, headers=headers or {})


def assert_openai_error(r, status, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code


def sum_by(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            value = line.split(f'{label}="')[1].split('"')[0]
            out[value] = out.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return out

