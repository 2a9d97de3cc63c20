"""One deployment of the Router's HTTP app for every test module of this package,
deleted when the package's last test has run (the three modules read the same app; a
deployment costs 20-25 s of a 2-core machine). A test that changes the app's state
(a workload profile, the learned corrections) leaves the others' expectations intact:
they read only what they send, and the profiles the admin tests change are theirs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.router_http.support import serve_router_app


@pytest.fixture(scope="package")
def client(ray_cluster, tiny_model_dir, tmp_path_factory) -> Iterator[httpx.Client]:
    yield from serve_router_app(ray_cluster, tiny_model_dir, tmp_path_factory)
