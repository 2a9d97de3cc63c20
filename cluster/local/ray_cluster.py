"""A local Ray + Serve for the demo and the cluster benchmark: start, deploy apps, stop
cleanly (Serve, then Ray, then a check that no process this one started is left).

Ray's CPU count is only accounting here; what keeps the replicas from fighting over two
cores is one torch thread per replica (`PoolConfig.torch_threads`, the default).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

NUM_RAY_CPUS = 8  # accounting only: room for two apps' replicas, routers and control planes
HEALTH_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_ingress_env() -> dict[str, str]:
    """Ray's environment for Serve's direct ingress (`LocalCluster.direct_url`) on a
    cluster of this machine alone. Serve holds an ingress replica's shutdown for a
    drain period (30 s by default) so that an external load balancer sees it go; no
    balancer fronts a local cluster, and the wait only delayed every stop by 30 s."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


@dataclass
class LocalCluster:
    """`with LocalCluster() as cluster: url = cluster.deploy("pd", args)`.

    Joins a Ray that this process already runs (a test session's) and then leaves it
    running; otherwise starts a local one and shuts it down on exit."""

    log: Callable[[str], None] = print
    serve_env: dict[str, str] = field(default_factory=dict)  # extra env for every Ray worker
    http_port: int | None = None
    owns_ray: bool = False
    apps: list[str] = field(default_factory=list)

    def __enter__(self) -> LocalCluster:
        import ray
        from ray import serve

        from transport.config import generate_key

        # One transport key for this session's apps (`build_app`, run in this process, reads
        # it), known here too: the benchmarks call a replica's worker stream directly
        # (cluster/bench/router_overhead.py).
        os.environ.setdefault("PDC_TRANSPORT_KEY", generate_key())
        if ray.is_initialized():
            self.log("joining the Ray instance this process already runs")
        else:
            self.owns_ray = True
            self.log(f"starting a local Ray instance ({os.cpu_count()} cores)")
            os.environ.update(self.serve_env)  # inherited by the raylet, so by every worker
            ray.init(address="local", num_cpus=NUM_RAY_CPUS, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}})
        self.http_port = self._serve_port(serve)
        return self

    def _serve_port(self, serve) -> int:
        """Serve's HTTP port: the running proxy's, else a fresh one on 127.0.0.1."""
        from ray.serve.context import _get_global_client

        try:
            client = _get_global_client()
        except Exception:  # noqa: BLE001 - Serve not started yet
            client = None
        if client is not None and getattr(client, "http_config", None) is not None:
            return int(client.http_config.port)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        return port

    def url(self, route_prefix: str = "/") -> str:
        return f"http://127.0.0.1:{self.http_port}{route_prefix.rstrip('/')}"

    def direct_url(self, app_name: str, route_prefix: str) -> str | None:
        """The app's ingress replica's own HTTP address under Serve's direct ingress
        (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1` in Ray's environment: each ingress replica
        listens itself, on the proxy's host, and an L4 balancer such as Serve's HAProxy
        mode fronts them instead of the Python proxy); None when it is off."""
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        for _ in range(100):
            for group in ray.get(controller.get_target_groups.remote(app_name)):
                targets = [t for t in group.targets if t.port != self.http_port]
                if str(group.protocol).endswith("HTTP") and targets:
                    # it binds the proxy's host (127.0.0.1 here), not the node IP it reports
                    return f"http://127.0.0.1:{targets[0].port}{route_prefix.rstrip('/')}"
            if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
                return None
            time.sleep(0.1)  # the replica's port is allocated once it is running
        return None

    def deploy(self, name: str, args: dict, route_prefix: str, expect: dict[str, int]) -> str:
        """Deploy `build_app(args)` as app `name` and wait until each pool in `expect`
        (`{"decode": 1, "prefill": 1}`) has that many healthy replicas; returns its URL."""
        return self.deploy_many([(name, args, route_prefix, expect)])[0]

    def deploy_many(self, apps: list[tuple[str, dict, str, dict[str, int]]]) -> list[str]:
        """Several `(name, args, route_prefix, expect)` apps at once (their replicas start
        in parallel); returns their URLs once all are healthy."""
        from ray import serve
        from ray.serve.api import RunTarget

        from cluster.app import build_app

        serve.run_many([RunTarget(build_app(args), name=name, route_prefix=prefix)
                        for name, args, prefix, _ in apps])
        self.apps.extend(name for name, *_ in apps)
        urls = [self.url(prefix) for _, _, prefix, _ in apps]
        for url, (*_, expect) in zip(urls, apps, strict=True):
            wait_healthy(url, expect)
        return urls

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        import ray
        from ray import serve

        if not self.owns_ray:
            for name in self.apps:
                serve.delete(name)
            return
        self.log("stopping Serve and Ray")
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        left = wait_children_gone()
        if left:
            self.log(f"warning: {len(left)} child processes still running: {left}")
        else:
            self.log("clean stop: Serve and Ray are down, no child process left")


def wait_healthy(url: str, expect: dict[str, int], timeout_s: float = HEALTH_TIMEOUT_S) -> dict:
    """Poll `/health` until status ok and each pool has the expected healthy replicas."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"{url}/health", timeout=5).json()
            pools = body.get("pools", {})
            if body.get("status") == "ok" and all(
                    pools.get(role, {}).get("healthy", 0) >= n for role, n in expect.items()):
                return body
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s:g} s; last /health: {body}")


def wait_children_gone(timeout_s: float = 10.0) -> list[str]:
    """Child processes of this one still alive after `timeout_s` (Ray's own exit is async)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in psutil.Process().children(recursive=True) if _alive(p)]
        if not left or time.monotonic() > deadline:
            return [f"{p.pid}:{_name(p)}" for p in left]
        time.sleep(0.25)


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001
        return "?"
