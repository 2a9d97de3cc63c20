"""One option at one rate: simulate it and keep what the planner ranks by.

"Meets the SLO" means at least `ATTAINMENT` of the requests meet both the TTFT and the
TPOT objective (the load tester's goodput rule, `meets_slo`). Arrivals come from the
load tester's own plans (a built-in workload or a workload file at a Poisson rate, or a
trace whose clock is stretched to the rate), so a plan and a real load test see the same
requests.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.config import SLO as ProfileSLO
from cluster.loadtest.config import SLO
from cluster.loadtest.workloads import RequestSpec
from cluster.plan.calibration import Calibration
from cluster.plan.options import PlanOption
from cluster.plan.sim.arrivals import Arrival, at_rate, from_trace
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.simulator import simulate

ATTAINMENT = 0.9  # the share of requests that must meet both objectives
# A run shorter than this builds no queue: at a high rate `num_requests` arrive in a
# moment and drain before the backlog shows, so a run lasts at least this long on the
# simulated clock (with at most MAX_REQUESTS_X times `num_requests`).
MIN_SIM_S = 60.0
MAX_REQUESTS_X = 10


@dataclass(frozen=True)
class Workload:
    """What arrives: a built-in workload or a workload file (`name`), or a trace."""

    name: str
    num_requests: int = 1000
    seed: int = 0
    prompt_factor: float = 1.0  # every prompt's text scaled by this (sensitivity)

    @property
    def is_trace(self) -> bool:
        return self.name.endswith(".jsonl")

    def count_at(self, rate: float) -> int:
        """Requests for one run at `rate`: `num_requests`, or enough for `MIN_SIM_S`."""
        return int(min(max(self.num_requests, math.ceil(rate * MIN_SIM_S)), MAX_REQUESTS_X * self.num_requests))

    def arrivals(self, rate: float) -> list[Arrival]:
        if self.is_trace:
            arrivals = _trace_at_rate(from_trace(self.name, seed=self.seed)[: self.num_requests], rate)
        else:
            arrivals = at_rate(self.name, rate, self.count_at(rate), self.seed)
        return scale_prompts(arrivals, self.prompt_factor) if self.prompt_factor != 1.0 else arrivals

    def with_prompts(self, factor: float) -> Workload:
        return dataclasses.replace(self, prompt_factor=self.prompt_factor * factor)


def _trace_at_rate(arrivals: list[Arrival], rate: float) -> list[Arrival]:
    """The trace's clock stretched so that it arrives at `rate` on average."""
    if len(arrivals) < 2 or arrivals[-1].at_s <= arrivals[0].at_s:
        return arrivals
    native = (len(arrivals) - 1) / (arrivals[-1].at_s - arrivals[0].at_s)
    stretch = native / rate
    start = arrivals[0].at_s
    return [Arrival((a.at_s - start) * stretch, a.spec) for a in arrivals]


def scale_prompts(arrivals: Sequence[Arrival], factor: float) -> list[Arrival]:
    """Each message's text cut or extended (by repeating itself) to `factor` of its length;
    identical texts stay identical, so shared prefixes stay shared."""
    return [Arrival(a.at_s, _scaled_spec(a.spec, factor)) for a in arrivals]


def _scaled_spec(spec: RequestSpec, factor: float) -> RequestSpec:
    messages = tuple({**m, "content": _scaled_text(m["content"], factor)} for m in spec.messages)
    return dataclasses.replace(spec, messages=messages)


def _scaled_text(text: str, factor: float) -> str:
    size = max(1, round(len(text) * factor))
    if not text:
        return text
    return (text * (size // len(text) + 1))[:size]


@dataclass(frozen=True)
class AttainmentPoint:
    """One run at one rate, as a saturation search reads it (simulated or real)."""

    rate: float
    attainment: float  # share of requests meeting both objectives

    @property
    def meets(self) -> bool:
        return self.attainment >= ATTAINMENT


@dataclass(frozen=True)
class PlanPoint:
    """One option simulated at one rate."""

    option: PlanOption
    rate: float
    attainment: float  # share of requests meeting both objectives
    goodput_rps: float
    throughput_rps: float
    ttft_ms: dict  # the load tester's latency blocks: mean, p50, p90, p95, p99, max
    tpot_ms: dict
    itl_ms: dict
    utilisation: dict[str, float]
    routes: dict[str, int]
    prediction_error: dict
    sim_wall_s: float

    @property
    def meets(self) -> bool:
        return self.attainment >= ATTAINMENT

    @property
    def goodput_per_replica(self) -> float:
        return self.goodput_rps / self.option.num_replicas

    def to_dict(self) -> dict:
        return {"config": self.option.name, "num_prefill": self.option.num_prefill,
                "num_decode": self.option.num_decode, "mode": self.option.mode,
                "min_remote_prefill_tokens": self.option.min_remote_prefill_tokens, "rate": self.rate,
                "meets_slo": self.meets, "slo_attainment": round(self.attainment, 4),
                "goodput_rps": self.goodput_rps, "goodput_per_replica": round(self.goodput_per_replica, 4),
                "throughput_rps": self.throughput_rps,
                "ttft_ms": _pick(self.ttft_ms, ("p50", "p90", "p99")), "tpot_ms": _pick(self.tpot_ms, ("p50", "p90")),
                "itl_ms": _pick(self.itl_ms, ("p50", "p99")),
                "utilisation": {k: round(v, 4) for k, v in self.utilisation.items()}, "routes": self.routes}


def _pick(block: dict, keys: Sequence[str]) -> dict:
    return {k: (round(block[k], 2) if block.get(k) is not None else None) for k in keys}


@dataclass(frozen=True)
class Evaluator:
    """Simulates options of one workload under one SLO and calibration."""

    calibration: Calibration
    workload: Workload
    slo: SLO
    replicas_per_node: int = 8
    on_point: Callable[[PlanPoint], None] | None = None  # progress

    def __call__(self, option: PlanOption, rate: float, workload: Workload | None = None) -> PlanPoint:
        workload = workload or self.workload
        profile = option.profile(ProfileSLO(ttft_ms=self.slo.ttft_ms, tpot_ms=self.slo.tpot_ms))
        config = SimConfig(num_prefill=option.num_prefill, num_decode=option.num_decode,
                           replicas_per_node=self.replicas_per_node, profiles={"default": profile},
                           default_slo=profile.slo, seed=workload.seed)
        result = simulate(config, self.calibration, workload.arrivals(rate), target_rate=rate)
        summary = result.summary(self.slo)
        point = PlanPoint(option, rate, summary.goodput["fraction"], summary.goodput["requests_per_s"],
                          summary.throughput["requests_per_s"], summary.ttft_ms, summary.tpot_ms, summary.itl_ms,
                          dict(result.utilisation), dict(summary.routes), summary.prediction_error, result.wall_s)
        if self.on_point is not None:
            self.on_point(point)
        return point


def load_slo(text: str) -> SLO:
    """`ttft_ms=X,tpot_ms=Y`: both are needed to plan."""
    slo = SLO.parse(text)
    if slo.ttft_ms is None or slo.tpot_ms is None:
        raise ValueError("give both limits, e.g. --slo ttft_ms=2000,tpot_ms=100")
    return slo


def save_points(points: Sequence[PlanPoint], path: Path) -> None:
    path.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in points))
