"""The benchmark's hands on the `pd` app while it runs: workload profiles and the routing
policy's state through the admin API, and the test-only KV fault through Serve handles.

The admin token is made here, written to a private temporary file that the app's config
names (`secrets.admin_token_file`), and never printed; the file goes when the bench ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx

from cluster.loadtest.config import SLO
from cluster.local.apps import workload_profile
from cluster.local.traffic import WORKLOAD_PREFIX
from router.decision_log import DECISION_LOG_SIZE


@contextlib.contextmanager
def admin_token_file() -> Iterator[tuple[str, str]]:
    """(path, token): a fresh token in a file only this user can read, removed after."""
    token = secrets.token_urlsafe(24)
    folder = tempfile.mkdtemp(prefix="pdc-bench-")
    path = Path(folder) / "admin_token"
    path.touch(mode=0o600)
    path.write_text(token)
    try:
        yield str(path), token
    finally:
        path.unlink(missing_ok=True)
        os.rmdir(folder)


class PolicyAdmin:
    """The admin API of one app. The bench's apps have one router replica, which applies
    a profile it is sent at once (the others, were there any, within 2 s)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self._headers = url, {"authorization": f"Bearer {token}"}

    def set_slos(self, slos: dict[str, SLO]) -> None:
        """Each request class's workload profile (`bench_<class>`, mode `auto`) with its SLO."""
        for class_name, slo in slos.items():
            self._call("PUT", f"/admin/workloads/{WORKLOAD_PREFIX}{class_name}",
                       json=workload_profile("auto", {k: float(v) for k, v in slo.as_dict().items()}))

    def reset(self) -> None:
        """Forget the policy's corrections, its prediction-error window and its decision log."""
        self._call("POST", "/admin/policy/reset")

    def describe(self) -> dict:
        """GET /admin/policy: the replicas' step and transfer models, the corrections and
        `prediction_error` (per route since the last reset: {ttft_mape, ttft_samples,
        tpot_mape, tpot_samples})."""
        return self._call("GET", "/admin/policy")

    def decisions(self) -> dict:
        """GET /admin/decisions: the router's routing decisions since the last reset (up to
        its log's size), each with every candidate it priced."""
        return self._call("GET", f"/admin/decisions?limit={DECISION_LOG_SIZE}")

    def _call(self, method: str, path: str, **kwargs) -> dict:
        resp = httpx.request(method, self.url + path, headers=self._headers, timeout=30, **kwargs)
        if resp.status_code != 200:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status_code} {resp.text[:300]}")
        return resp.json()


def set_prefill_faults(app: str, spec: dict) -> list[dict]:
    """`set_faults(spec)` on every healthy prefill replica of `app` (a Serve handle call
    from this Ray driver; each call replaces the replica's whole fault spec)."""
    from ray import serve

    from workers.invariants import Probe

    state = serve.get_deployment_handle("ControlPlane", app).get_state.remote(None).result(timeout_s=30)
    handle = serve.get_deployment_handle("PrefillWorker", app)
    return [handle.set_faults.remote(spec, Probe(r.replica_id)).result(timeout_s=30)
            for r in state.replicas if r.healthy and r.role == "prefill"]
