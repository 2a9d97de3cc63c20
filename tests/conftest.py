"""Shared fixtures: one tiny model per test session (and one Ray cluster, where used)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores on CI: keep torch from oversubscribing when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from workers.model_files import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", 0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (and Serve on a free port) for the whole session."""
    import ray
    from ray import serve

    # The key `build_app` (run in this process) hands to the session's apps; known here too.
    os.environ.setdefault("PDC_TRANSPORT_KEY", "test-transport-key-0123456789")
    if not ray.is_initialized():
        # address="local": always a fresh cluster of our own, never one left running.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"http_port": port}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """Ray for tests that need only Ray itself: the session's one cluster, the one
    `ray_cluster` starts, so two fixtures never race to configure it differently."""
    import ray

    return ray
