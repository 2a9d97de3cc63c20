"""Run an experiment: baseline and variants interleaved over the repeats (A B C A B C ...),
each run with the same arrivals and lengths and fresh prompt bytes, the cluster drained
between runs, every profile change journaled and rolled back after each run and at the
end (also on Ctrl-C, a failed run or a lost connection)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cluster.experiment.admin import AdminClient, AdminError, normalized
from cluster.experiment.journal import Journal
from cluster.experiment.quality import send
from cluster.experiment.rollback import Profiles
from cluster.experiment.runs import RunKey, RunResult, load_records, save_samples
from cluster.experiment.spec import Client, ExperimentSpec, Variant, WorkloadRef
from cluster.loadtest.prompt_blocks import run_salt
from cluster.loadtest.server_metrics import fetch, parse

BASELINE = "baseline"
VISIBLE_STREAK = 4  # /health answers in a row showing the new profiles version (every router replica)
VISIBLE_TIMEOUT_S = 5.0


@dataclass
class Experiment:
    spec: ExperimentSpec
    url: str
    out_dir: Path
    snapshot: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[RunResult] = field(default_factory=list)
    stopped: str | None = None  # why the experiment ended early
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))  # fresh prompt bytes per experiment

    def keys(self) -> list[RunKey]:
        return run_order(self.spec)


def run_order(spec: ExperimentSpec) -> list[RunKey]:
    names = [BASELINE, *(v.name for v in spec.variants)]
    keys, index = [], 0
    for repeat in range(1, spec.repeats + 1):
        for workload in spec.workloads:
            for name in names:
                keys.append(RunKey(index, repeat, workload.name, name))
                index += 1
    return keys


def variant(spec: ExperimentSpec, name: str) -> Variant | None:
    return next((v for v in spec.variants if v.name == name), None)


def base_profile(spec: ExperimentSpec, snapshot: dict[str, dict], workload: str) -> dict[str, Any]:
    """What the baseline runs use: the profile as it is (the `default` one when the name has
    none), with the baseline's own fields set over it."""
    current = snapshot.get(workload) or snapshot.get("default") or {}
    return normalized({**current, **(spec.baseline.profile or {})})


def profile_for(spec: ExperimentSpec, snapshot: dict[str, dict], workload: str, name: str) -> dict | None:
    """The profile a run sets; None: leave the deployment's as it is."""
    v = variant(spec, name)
    if not spec.baseline.profile and (v is None or not v.profile):
        return None
    return normalized({**base_profile(spec, snapshot, workload), **(v.profile if v else {})})


def client_for(spec: ExperimentSpec, name: str) -> Client:
    v = variant(spec, name)
    base, change = spec.baseline.client, (v.client if v else Client())
    return Client(mode=change.mode or base.mode, endpoint=change.endpoint or base.endpoint,
                  headers={**base.headers, **change.headers})


def describe_plan(spec: ExperimentSpec, snapshot: dict[str, dict] | None) -> list[str]:
    """What a run of `spec` would do, for --dry-run and the report's head."""
    lines = [f"{len(run_order(spec))} runs: {spec.repeats} repeats x {len(spec.workloads)} workloads x "
             f"{1 + len(spec.variants)} arms (baseline first), interleaved; load "
             f"{_load_text(spec)}; quality samples: {len(spec.samples)}"]
    for w in spec.workloads:
        lines.append(f"workload {w.name} (x-workload; traffic {w.trace or w.load}):")
        for name in [BASELINE, *(v.name for v in spec.variants)]:
            client = client_for(spec, name)
            if snapshot is None:
                profile_text = "profile: unknown (deployment not read)"
            else:
                profile = profile_for(spec, snapshot, w.name, name)
                profile_text = "profile as it is" if profile is None else f"PUT profile {profile}"
            client_text = ", ".join(f"{k}={v}" for k, v in client.items().items()) or "client as configured"
            lines.append(f"  {name}: {profile_text}; {client_text}")
    return lines


def _load_text(spec: ExperimentSpec) -> str:
    shape = f"rate {spec.rate}/s" if spec.rate else f"concurrency {spec.concurrency or 1}"
    return f"{shape}, {', '.join(f'{k}={v}' for k, v in spec.bound().items())}"


def wait_drained(url: str, timeout_s: float) -> bool:
    """Until no request runs or waits on any replica (two readings in a row)."""
    deadline, quiet = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            families = parse(fetch(url))
        except httpx.HTTPError:
            quiet = 0
        else:
            busy = sum(v for name in ("pdc_num_requests_running", "pdc_num_requests_waiting")
                       for _, v in families.get(name, ()))
            quiet = quiet + 1 if busy == 0 else 0
            if quiet >= 2:
                return True
        time.sleep(0.25)
    return False


def wait_visible(url: str, version: int) -> None:
    """Until the routers answer with profiles at least `version` (they poll every ~0.5 s)."""
    deadline, streak = time.monotonic() + VISIBLE_TIMEOUT_S, 0
    while time.monotonic() < deadline and streak < VISIBLE_STREAK:
        try:
            seen = httpx.get(f"{url}/health", timeout=5.0).json().get("workloads_version", 0)
        except (httpx.HTTPError, ValueError):
            seen = 0
        streak = streak + 1 if seen >= version else 0
        time.sleep(0.1)


def _loadtest_config(spec: ExperimentSpec, url: str, workload: WorkloadRef, client: Client, key: RunKey,
                     out_dir: Path, nonce: str = ""):
    from cluster.loadtest.config import SLO, LoadTestConfig

    return LoadTestConfig(
        url=url, out_dir=out_dir, workload=workload.load, rate=spec.rate, concurrency=spec.concurrency,
        trace=Path(workload.trace) if workload.trace else None, seed=spec.seed,
        endpoint=client.endpoint or spec.endpoint, slo=SLO(**spec.slo.model_dump()), mode=client.mode,
        headers={"x-workload": workload.name, **client.headers}, prompt_salt=run_salt(f"{spec.seed}:{nonce}", key.index),
        timeout_s=spec.request_timeout_s, progress=False, plots=False, save_metrics=True, **spec.bound())


def run_one(exp: Experiment, profiles: Profiles, key: RunKey, journal: Journal) -> RunResult:
    from cluster.loadtest.api import run_loadtest

    spec = exp.spec
    workload = next(w for w in spec.workloads if w.name == key.workload)
    result = RunResult(key, exp.out_dir / "runs" / key.folder, started_at=time.time())
    if not wait_drained(exp.url, spec.drain_timeout_s):
        journal.write("drain_timeout", run=key.folder, seconds=spec.drain_timeout_s)
    profile = profile_for(spec, exp.snapshot, key.workload, key.variant)
    try:
        if profile is not None:
            wait_visible(exp.url, profiles.apply(key.workload, profile))
        client = client_for(spec, key.variant)
        journal.write("run_start", run=key.folder, workload=key.workload, variant=key.variant, repeat=key.repeat)
        config = _loadtest_config(spec, exp.url, workload, client, key, result.out_dir, exp.nonce)
        summary = run_loadtest(config)
        result.records = load_records(result.out_dir)
        _check_reachable(result)
        result.samples = _send_samples(exp, key, client, summary.env.get("model"))
        save_samples(result.out_dir, result.samples)
    finally:
        if profile is not None:
            profiles.restore_all()
        result.ended_at = time.time()
        journal.write("run_end", run=key.folder)
    return result


LOST = ("connect_error", "connection_lost")


def _check_reachable(result: RunResult) -> None:
    """A run in which no request reached the deployment stops the experiment."""
    if result.records and all(r.error_kind in LOST for r in result.records):
        raise ConnectionError(f"run {result.key.folder}: every request failed to reach the deployment "
                              f"({result.records[0].error})")


def _send_samples(exp: Experiment, key: RunKey, client: Client, model: str | None) -> list:
    spec = exp.spec
    headers = {"x-workload": key.workload, **client.headers}
    if client.mode:
        headers["x-pd-mode"] = client.mode
    endpoint = client.endpoint or spec.endpoint
    with httpx.Client(timeout=spec.request_timeout_s) as http:
        return [send(http, exp.url, sample, i, endpoint, model, headers) for i, sample in enumerate(spec.samples)]


def run_experiment(spec: ExperimentSpec, url: str, out_dir: Path, token: str | None,
                   on_run: Callable[[RunResult, int], None] | None = None) -> Experiment:
    """Run every run in order; profiles are restored after each and, whatever happens, at
    the end. A run that fails, Ctrl-C or a lost connection stops the experiment with the
    runs so far (`Experiment.stopped` says why); only a failed restore raises."""
    exp = Experiment(spec, url.rstrip("/"), Path(out_dir))
    journal = Journal(exp.out_dir)
    admin = AdminClient(exp.url, token)
    profiles = Profiles(admin, journal)
    exp.snapshot = profiles.snapshot
    journal.write("start", name=spec.name, url=exp.url, runs=[k.folder for k in exp.keys()])
    try:
        for key in exp.keys():
            exp.results.append(run_one(exp, profiles, key, journal))
            if on_run is not None:
                on_run(exp.results[-1], len(exp.keys()))
    except BaseException as e:  # noqa: BLE001 - Ctrl-C and failures alike: stop, restore, report
        exp.stopped = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        journal.write("stopped", reason=exp.stopped)
    finally:
        try:
            profiles.restore_all()
        except AdminError as e:
            journal.write("restore_failed", reason=str(e))
            raise AdminError(f"{e}; restore later with `pdcluster experiment --rollback {exp.out_dir}`") from None
        finally:
            journal.write("end")
            admin.close()
    return exp
