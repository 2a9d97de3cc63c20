"""Gather the evidence: a live window of `/metrics` (or a run folder's own), `/health`,
and, with an admin token, the profiles and the router's engine settings."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from cluster.doctor.evidence import Evidence
from cluster.doctor.window import Window, from_texts, read_window
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.server_metrics import SAMPLE_INTERVAL_S, fetch, gauges_of


class Unreachable(RuntimeError):
    """The deployment did not answer at all."""


def read_records(run_dir: Path) -> list[RequestRecord]:
    from cluster.loadtest.report import read_records as read_run

    if not (Path(run_dir) / "requests.jsonl").exists():
        raise ValueError(f"{run_dir}: no requests.jsonl (a `pdcluster loadtest` output folder is expected)")
    return read_run(run_dir)


def live_window(client: httpx.Client, url: str, seconds: float,
                interval_s: float = SAMPLE_INTERVAL_S) -> Window:
    """Sample `/metrics` for `seconds`: the first and last expositions and the gauges between."""
    first = fetch(url, client=client, fresh=True)
    gauges = [(time.time(), gauges_of(first))]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
        gauges.append((time.time(), gauges_of(fetch(url, client=client))))
    last = fetch(url, client=client, fresh=True)
    gauges.append((time.time(), gauges_of(last)))
    return from_texts(first, last, gauges, seconds)


def _admin(client: httpx.Client, url: str, path: str, token: str | None, notes: list[str]) -> dict | None:
    if not token:
        return None
    try:
        response = client.get(url + path, headers={"authorization": f"Bearer {token}"})
    except httpx.HTTPError as e:
        notes.append(f"{path}: {e!r}")
        return None
    if response.status_code != 200:
        notes.append(f"{path}: HTTP {response.status_code} (check PDC_ADMIN_TOKEN)")
        return None
    return response.json()


def collect(url: str, run_dir: Path | None = None, window_s: float = 10.0, token: str | None = None,
            timeout_s: float = 10.0) -> Evidence:
    """Everything `doctor` reads. With `run_dir`, the metrics window is the run's own when
    it saved one (`loadtest --save-metrics`); otherwise a live window of `window_s`. A run
    folder that cannot be read is a note, not a failure: `Unreachable` (the deployment
    does not answer) is the only error."""
    url = url.rstrip("/")
    ev = Evidence()
    with httpx.Client(timeout=timeout_s) as client:
        try:
            health = client.get(f"{url}/health")
        except httpx.HTTPError as e:
            raise Unreachable(f"cannot reach {url}: {e!r}") from None
        ev.health = _json_or_none(health)
        if run_dir is not None:
            try:
                ev.records = read_records(run_dir)
                ev.window = read_window(run_dir)
                ev.source = f"run {run_dir}" + ("" if ev.window else " (no metrics saved: live window)")
            except (ValueError, OSError) as e:  # the deployment is still worth diagnosing
                ev.notes.append(f"--run {run_dir} not read ({e}): live evidence only")
        if ev.window is None:
            try:
                ev.window = live_window(client, url, window_s)
                ev.source = ev.source or f"live, {window_s:g} s"
            except httpx.HTTPError as e:
                ev.notes.append(f"/metrics: {e!r}")
        workloads = _admin(client, url, "/admin/workloads", token, ev.notes)
        ev.profiles = (workloads or {}).get("workloads")
        steps = _admin(client, url, "/admin/steps?limit=0", token, ev.notes)
        ev.engine = (steps or {}).get("engine")
        ev.policy = _admin(client, url, "/admin/policy", token, ev.notes)
    if not token:
        ev.notes.append("no admin token (PDC_ADMIN_TOKEN): profile thresholds assumed at their defaults")
    return ev


def _json_or_none(response: httpx.Response) -> dict | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
