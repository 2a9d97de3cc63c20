"""A real run, read back and simulated again: the same requests at the same offsets, on
the same cluster shape, under the same routing.

A run directory (`pdcluster loadtest --out DIR --save-steps`) says everything a replay
needs: `summary.json` names the load (workload, rate or trace, seed, request count,
`x-pd-mode`) and the SLO; the load tester rebuilds the very same open-loop plan from
those; `deployment.json` names each replica's role and, when the admin API answered,
the workload profiles the router routed by; `requests.jsonl` is what was measured.
A closed-loop run (`--concurrency`) cannot be replayed: its arrivals depend on its own
latencies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.config import WorkloadProfile
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO, LoadTestConfig
from cluster.loadtest.metrics import Summary
from cluster.loadtest.report import read_records, read_summary
from cluster.plan.calibration import Calibration
from cluster.plan.records import DEPLOYMENT_FILE
from cluster.plan.sim.arrivals import Arrival, from_config
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.result import SimResult
from cluster.plan.sim.simulator import simulate

_NO_URL = "sim://"


class ReplayError(ValueError):
    """The run directory cannot be replayed; the message says why and what to do."""


@dataclass(frozen=True)
class Deployment:
    """The cluster a run ran on, as its replicas reported themselves."""

    num_prefill: int
    num_decode: int
    profiles: dict[str, WorkloadProfile]  # {"default": WorkloadProfile()} when the router did not say
    replica_ids: tuple[str, ...]

    @property
    def key(self) -> str:
        """Runs with the same key ran on the same replicas (one calibration serves them)."""
        return ",".join(self.replica_ids)

    @property
    def name(self) -> str:
        if self.num_prefill == 0:
            return f"{self.num_decode}-colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"


@dataclass(frozen=True)
class RecordedRun:
    path: Path
    load: LoadTestConfig  # the load test, rebuilt (no URL): its plan is the run's arrivals
    mode: str | None  # x-pd-mode the load tester sent
    slo: SLO
    deployment: Deployment
    records: list[RequestRecord]  # measured
    summary: Summary  # measured

    @property
    def target_rate(self) -> float | None:
        return self.load.rate

    def arrivals(self) -> list[Arrival]:
        arrivals = from_config(self.load)
        if len(arrivals) != len(self.records):
            raise ReplayError(f"{self.path}: the rebuilt plan has {len(arrivals)} requests, the run "
                              f"{len(self.records)}; was it cut short (--duration) or sent by another version?")
        return arrivals


def read_run(run_dir: str | Path) -> RecordedRun:
    path = Path(run_dir)
    for name in ("summary.json", "requests.jsonl", DEPLOYMENT_FILE):
        if not (path / name).exists():
            raise ReplayError(f"{path}: no {name}; replay needs a run saved with `pdcluster loadtest --out DIR "
                              f"--save-steps` against a deployment with the admin API on")
    summary = read_summary(path)
    env = summary.env
    return RecordedRun(path, _load_config(path, env), env.get("mode"), SLO(**summary.goodput.get("slo", {})),
                       read_deployment(path / DEPLOYMENT_FILE), read_records(path), summary)


def _load_config(path: Path, env: dict) -> LoadTestConfig:
    load = env.get("load") or {}
    common = {"workload": env.get("workload", "chat-short"), "seed": env.get("seed", 0)}
    if load.get("kind") == "open":
        return LoadTestConfig(_NO_URL, rate=load["rate"], burstiness=load.get("burstiness", 1.0),
                              num_requests=env.get("num_requests"), duration_s=env.get("duration_limit_s"),
                              **common)
    if load.get("kind") == "ramp":
        return LoadTestConfig(_NO_URL, ramp=(load["start_rate"], load["end_rate"]),
                              num_requests=env.get("num_requests"), duration_s=env.get("duration_limit_s"),
                              **common)
    if load.get("kind") == "trace":
        trace = _trace_file(path, load.get("file"))
        workload = str(trace) if Path(common["workload"]).name == trace.name else common["workload"]
        return LoadTestConfig(_NO_URL, trace=trace, workload=workload, seed=common["seed"])
    raise ReplayError(f"{path}: a {load.get('kind', 'unknown')}-loop run cannot be replayed (its arrivals "
                      f"follow its own latencies); record it open-loop: --rate, --ramp or --trace")


def _trace_file(path: Path, recorded: str | None) -> Path:
    """The trace as recorded, or the run folder's own trace.jsonl when the run moved."""
    for candidate in (Path(recorded) if recorded else None, path / "trace.jsonl"):
        if candidate is not None and candidate.exists():
            return candidate
    raise ReplayError(f"{path}: the trace {recorded} is gone and the folder has no trace.jsonl")


def read_deployment(path: Path) -> Deployment:
    data = json.loads(path.read_text())
    roles = {rid: r.get("role") for rid, r in data.get("replicas", {}).items()}
    if not roles:
        raise ReplayError(f"{path}: no replica reported itself; the run sent no traffic while its steps "
                          f"were collected")
    profiles = {name: WorkloadProfile.model_validate(p) for name, p in data.get("workloads", {}).items()}
    profiles.setdefault("default", WorkloadProfile())
    return Deployment(sum(r == "prefill" for r in roles.values()), sum(r == "decode" for r in roles.values()),
                      profiles, tuple(sorted(roles)))


def sim_config(run: RecordedRun, seed: int | None = None) -> SimConfig:
    """The run's cluster on one node (a local deployment), its profiles and forced mode."""
    d = run.deployment
    return SimConfig(num_prefill=d.num_prefill, num_decode=d.num_decode,
                     replicas_per_node=max(1, d.num_prefill + d.num_decode), profiles=d.profiles,
                     forced_mode=run.mode, seed=run.load.seed if seed is None else seed)


def replay(run: RecordedRun, calibration: Calibration) -> SimResult:
    return simulate(sim_config(run), calibration, run.arrivals(), target_rate=run.target_rate)
