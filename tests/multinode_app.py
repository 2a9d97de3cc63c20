"""Run by tests/test_cluster_multinode.py in its own process (its own Ray cluster, so it
never collides with the test session's): a head node without workers' resources, a
`prefill` node and a `decode` node (separate raylets on this machine), the app placed by
custom resources, KV crossing between the nodes over TCP. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx


def main(model_dir: str, port: int) -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.app import build_app

    os.environ.setdefault("PDC_TRANSPORT_KEY", "multinode-test-key-0123456789")  # read by build_app here
    env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    prefill_node = cluster.add_node(num_cpus=1, resources={"prefill": 1})
    decode_node = cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "model": {"path": model_dir},
            "engine": {"num_kv_blocks": 128},
            "prefill": {"num_cpus": 0.5, "resources": {"prefill": 1}},
            "decode": {"num_cpus": 0.5, "resources": {"decode": 1}},
            "router": {"num_cpus": 0.5},
            # `auto`: shared memory only when both ends share a node; these must use TCP.
            "transport": {"backend": "auto", "host": "127.0.0.1"},
        }
        serve.run(build_app(args), name="pd-multinode", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_ok(url)
        control = serve.get_deployment_handle("ControlPlane", "pd-multinode")
        replicas = control.get_state.remote(None).result().replicas
        nodes = {r.role: r.node_id for r in replicas}
        outs = {}
        for mode in ("local", "disagg"):
            r = httpx.post(f"{url}/v1/completions", headers={"x-pd-mode": mode}, timeout=60,
                           json={"model": "tiny", "prompt": list(range(30, 100)), "max_tokens": 8,
                                 "temperature": 0, "return_token_ids": True})
            outs[mode] = {"status": r.status_code, "route": r.headers.get("x-pd-route"),
                          "token_ids": r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None}
        time.sleep(2.5)  # worker metrics reach /metrics with the next heartbeat and push
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        print(json.dumps({
            "nodes": nodes, "prefill_node": prefill_node.node_id, "decode_node": decode_node.node_id,
            "outs": outs, "transfer_bytes": _metric(metrics, "pdc_kv_transfer_bytes_total"),
            "backends": sorted({line.split('backend="')[1].split('"')[0] for line in metrics.splitlines()
                                if line.startswith("pdc_kv_transfer_seconds_count")}),
        }))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _wait_ok(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit("cluster did not become healthy")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
