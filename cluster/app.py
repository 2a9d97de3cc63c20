"""`build_app(args) -> serve.Application`: the one builder behind `serve run`, `serve deploy`,
a KubeRay RayService (`import_path: cluster.app:build_app` + `args`) and `pdcluster serve`.

    ControlPlane (1)  <- register/heartbeat --  PrefillWorker (n)  --KV-->  DecodeWorker (m)
         ^  profiles, registry, metrics                ^  prefill()              ^  generate()
         |                                              |                        |
    Router ingress (HTTP)  -- picks a decode replica, decides the route ---------+

`args` is the cluster config as a dict (or `{"config_file": PATH, ...overrides}`).
Live settings travel as `user_config`: the workload profiles (to the ControlPlane, which
every router polls) and the log level (to every worker). A redeploy that edits only a
deployment's `user_config` reaches the running replicas through `reconfigure` without a
restart; editing `args` changes the app's code version, so Serve replaces its replicas.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray.serve import Application

from cluster.config import ClusterConfig, ConfigError, PoolConfig, load_config

# Fast failure detection: a dead engine loop or replica is replaced within seconds.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
MIN_KEY_LEN = 16  # characters of the transport key


def build_app(args: dict[str, Any] | None = None) -> Application:
    config = load_config(args or {})
    config_args = config.to_args()
    key = transport_key(config)
    control_plane = _control_plane(config)
    prefill = _pool(config, "prefill").bind(config_args, control_plane, key) if config.prefill.enabled else None
    decode = (_pool(config, "decode").bind(config_args, prefill, control_plane, key)
              if config.decode.enabled else None)
    return _router(config).bind(config_args, control_plane, decode, prefill, key)


def transport_key(config: ClusterConfig) -> str:
    """The shared key of the KV transport and the worker stream (HMACs on every message),
    resolved here once and handed to every worker and router as a constructor argument;
    nothing below reads a key file or the environment. The first that is set wins:

    1. `transport.key_file`, 2. `secrets.transport_key_file`, 3. the variable named by
    `secrets.transport_key_env` (`$PDC_TRANSPORT_KEY`), 4. a fresh key for this deployment,
    shared by all its replicas. Never logged, never in an error."""
    from transport.config import generate_key

    env = config.secrets.transport_key_env
    looked = f"transport.key_file, secrets.transport_key_file, ${env}"
    for where, file in (("transport.key_file", config.transport.key_file),
                        ("secrets.transport_key_file", config.secrets.transport_key_file)):
        if file:
            return _checked_key(_read_key_file(file, where), f"{where} {file}", looked)
    if os.environ.get(env):
        return _checked_key(os.environ[env], f"${env}", looked)
    return generate_key()


def _read_key_file(file: str, where: str) -> str:
    try:
        return Path(file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {where} {file}: {e.strerror}") from None


def _checked_key(key: str, source: str, looked: str) -> str:
    if len(key) < MIN_KEY_LEN:
        raise ConfigError(f"the transport key from {source} is shorter than {MIN_KEY_LEN} "
                          f"characters (looked at, in order: {looked})")
    return key


def _control_plane(config: ClusterConfig):
    from router.control_plane import ControlPlane

    workloads = {name: p.model_dump() for name, p in config.workloads.items()}
    # Heartbeats arrive every 0.5 s from every replica: no access-log line for each.
    return ControlPlane.options(user_config={"workloads": workloads},
                                logging_config={"enable_access_log": False}).bind(
        workloads, config.router.heartbeat_timeout_s)


def _pool(config: ClusterConfig, role: str):
    from router.replica_router import request_router_config

    if role == "prefill":
        from workers.prefill import PrefillDeployment as deployment
        pool: PoolConfig = config.prefill
    else:
        from workers.decode import DecodeDeployment as deployment
        pool = config.decode
    options = pool.deployment_options()
    if config.router.worker_stream and "autoscaling_config" in options:
        from workers.autoscaling import with_stream_policy

        options["autoscaling_config"] = with_stream_policy(options["autoscaling_config"])
    return deployment.options(
        **options,
        request_router_config=request_router_config(),
        user_config={"log_level": config.log_level},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    )


def _router(config: ClusterConfig):
    from router.ingress import Router

    # A router relays its workers' streams, and a redeploy replaces it too: it waits as long
    # as the longest-lived pool lets its streams run.
    grace = max(config.prefill.graceful_shutdown_s, config.decode.graceful_shutdown_s)
    return Router.options(
        num_replicas=config.router.num_replicas,
        ray_actor_options={"num_cpus": config.router.num_cpus},
        graceful_shutdown_timeout_s=grace,
    )
