"""Arrivals: when each request comes and what it is, from the load tester's own plans.

The load tester turns a `LoadTestConfig` into scheduled requests (`build_plan`: a
built-in or file workload at a Poisson/gamma rate or a ramp, or a `trace.jsonl` with
timestamps); the simulator takes exactly those, so a simulated run and a real one see
the same requests at the same offsets for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.runner import build_plan
from cluster.loadtest.workloads import RequestSpec

_NO_URL = "sim://"  # a plan is built without a server


@dataclass(frozen=True)
class Arrival:
    at_s: float  # offset from the run's start
    spec: RequestSpec


def from_config(config: LoadTestConfig) -> list[Arrival]:
    """The open-loop plan of a load test config (rate, ramp or trace)."""
    plan = build_plan(config)
    if not plan.is_open_loop:
        raise ValueError("the simulator replays open-loop plans: give a rate, a ramp or a trace")
    return [Arrival(t, spec) for t, spec in zip(plan.offsets, plan.specs, strict=True)]


def at_rate(workload: str, rate: float, num_requests: int, seed: int = 0, burstiness: float = 1.0) -> list[Arrival]:
    """A built-in workload (or a workload file) at `rate` requests/s."""
    return from_config(LoadTestConfig(_NO_URL, workload=workload, rate=rate, burstiness=burstiness,
                                      num_requests=num_requests, seed=seed))


def from_trace(path: str | Path, workload: str = "chat-short", seed: int = 0) -> list[Arrival]:
    """A `trace.jsonl` (rows with `timestamp`, and `prompt_len`/`prompt`/`messages`,
    `output_len`, `workload`); rows without a request take `workload`'s next one."""
    return from_config(LoadTestConfig(_NO_URL, workload=workload, trace=Path(path), seed=seed))
