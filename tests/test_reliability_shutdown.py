"""Scale-down and redeploys on real Ray Serve: a replica being removed lets its open
streams run for its pool's `graceful_shutdown_s` (the worker-stream drain, which Serve's own
wait does not cover) and so does the router relaying them, so a long stream survives the
deletion of its whole app instead of ending at Serve's default 5 s with `replica_failed`."""

from __future__ import annotations

import json
import threading

import httpx

APP = "pdc-shutdown"
TOKENS = 3500  # ~10 s on the tiny model on 2 cores: longer than Serve's default grace


def test_a_long_stream_outlives_its_apps_deletion(ray_cluster, tiny_model_dir):
    from ray import serve

    from cluster.app import build_app

    config = {
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_kv_blocks": 512, "max_num_seqs": 4},
        "transport": {"host": "127.0.0.1"},
        "prefill": {"num_replicas": 0},
        "decode": {"num_replicas": 1, "graceful_shutdown_s": 90},
        "router": {"num_cpus": 0},
        "limits": {"default_max_tokens": 16, "max_tokens_limit": TOKENS},
    }
    serve.run(build_app(config), name=APP, route_prefix="/shutdown")
    deleted = threading.Event()
    deleter = threading.Thread(target=lambda: (serve.delete(APP), deleted.set()), daemon=True)
    body = {"prompt": "tell a long story", "stream": True, "max_tokens": TOKENS,
            "ignore_eos": True, "temperature": 0}
    url = f"http://127.0.0.1:{ray_cluster['http_port']}/shutdown/v1/completions"
    chunks, finish, errors = 0, None, []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            chunks += 1
            finish = event["choices"][0].get("finish_reason") or finish
            if chunks == 50:
                deleter.start()  # the app goes away under the stream
    assert deleter.is_alive() or deleted.is_set(), "the deletion never started"
    assert not errors, errors
    assert finish == "length"
    deleter.join(120)
    assert deleted.is_set()
