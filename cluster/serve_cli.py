"""`pdcluster serve`: start (or join) Ray, deploy the app, block; SIGINT/SIGTERM tear down.

Without `RAY_ADDRESS` a local Ray instance is started and shut down on exit; with it,
only this app is deployed and, on exit, deleted (the cluster and its other apps stay).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import typer

from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.model_check import check_model_dir
from cluster.tls import base_url, http_options
from workers.model_files import resolve_model_path

APP_NAME = "pdcluster"
log = logging.getLogger("pdcluster.serve")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @app.command("serve")
    def serve_cmd(
        config: Path = typer.Option(None, "--config", help="Cluster config YAML (default: tiny model, 1+1 CPU replicas)."),
        model: Path = typer.Option(None, "--model", help="HuggingFace model folder; overrides model.path."),
        host: str = typer.Option(None, "--host", help="HTTP host (default 127.0.0.1 or the config's router.host)."),
        port: int = typer.Option(None, "--port", help="HTTP port (default 8000 or the config's router.port)."),
    ) -> None:
        """Deploy the disaggregated serving app and serve the OpenAI-compatible HTTP API."""
        try:
            args = serve_args(config, model, host, port)
            cluster_config = load_config(args)
            check_model_dir(resolve_model_path(cluster_config.model))  # a bad folder fails here, naming it
            http_options(cluster_config)  # TLS files exist
        except ConfigError as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(run_server(args, cluster_config))


def serve_args(config: Path | None, model: Path | None, host: str | None, port: int | None) -> dict:
    """Serve `args` for `build_app`: the config file plus the command line's overrides."""
    args: dict = {"config_file": str(config)} if config else {}
    if model is not None:
        args["model"] = {"path": str(model)}
    router = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if router:
        args["router"] = router
    return args


def run_server(args: dict, config: ClusterConfig, stop: threading.Event | None = None) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app

    try:
        app = build_app(args)  # resolves the transport key: a bad one fails here, before Ray starts
    except ConfigError as e:
        typer.echo(str(e), err=True)
        return 2
    external = bool(os.environ.get("RAY_ADDRESS"))
    if external:
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=_num_cpus(config), include_dashboard=False,
                 log_to_driver=False)
    stop = stop or _stop_on_signals()  # after ray.init, which installs its own handlers
    try:
        serve.start(http_options=http_options(config))  # host, port, TLS
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        url = base_url(config)
        typer.echo(f"pdcluster serving {config.model.served_name} at {url} (Ctrl-C to stop)", err=True)
        stop.wait()
        typer.echo("stopping pdcluster ...", err=True)
        return 0
    finally:
        _teardown(external)


def _teardown(external: bool) -> None:
    import ray
    from ray import serve

    try:
        if external:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame):  # noqa: ARG001
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop


def _num_cpus(config: ClusterConfig) -> int:
    """Ray's CPU count is accounting, not pinning: make room for every replica the config
    asks for even on a 2-core machine (torch threads are pinned per replica instead)."""
    pools = [(config.prefill, _max_replicas(config.prefill)), (config.decode, _max_replicas(config.decode))]
    needed = sum(pool.num_cpus * n for pool, n in pools)
    needed += config.router.num_cpus * config.router.num_replicas + 1  # + Serve's own actors
    return max(os.cpu_count() or 1, int(needed + 0.999))


def _max_replicas(pool) -> int:
    if pool.autoscaling_config is not None:
        return int(pool.autoscaling_config.get("max_replicas", 1))
    return pool.num_replicas
