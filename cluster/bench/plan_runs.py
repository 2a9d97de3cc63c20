"""The planner benchmark's real runs: one deployment, one workload, a saturation search
by real load tests, then runs at fractions of the capacity it found.

Every run is an open-loop load test (`pdcluster loadtest --rate R --num-requests N
--seed S --save-steps`), so `plan validate` can rebuild its arrivals exactly and fit a
calibration from its records. Each run has its own seed: fresh prompt bytes, so no run
rides another's prefix cache. The search is the planner's own (`saturation_rate`):
grow or shrink the rate by `factor` until a rate that meets the SLO and one that does
not are adjacent, then bisect to `rel_tol`.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.loadtest.config import SLO
from cluster.plan.evaluate import AttainmentPoint
from cluster.plan.saturation import saturation_rate
from cluster.plan.validate import figures_of, write_search

PAUSE_S = 1.0  # between runs: the last streams drain, heartbeats show an idle cluster


@dataclass(frozen=True)
class RealPoint(AttainmentPoint):
    run: str = ""  # the run's folder, relative to the search's
    figures: dict = field(default_factory=dict)


@dataclass
class Runner:
    """Load tests against one app: `url`, the admin token to save its records, and a
    seed counter shared by every run of the benchmark."""

    url: str
    token: str
    mode: str | None
    seeds: itertools.count
    log: Callable[[str], None] = print

    def run(self, workload: str, rate: float, num_requests: int, slo: SLO, out_dir: Path) -> RealPoint:
        from cluster.loadtest.api import run_loadtest
        from cluster.loadtest.config import LoadTestConfig

        seed = next(self.seeds)
        summary = run_loadtest(LoadTestConfig(
            url=self.url, out_dir=out_dir, workload=workload, rate=rate, num_requests=num_requests, seed=seed,
            mode=self.mode, slo=slo, plots=False, save_steps=True, admin_token=self.token, timeout_s=300.0))
        time.sleep(PAUSE_S)
        figures = {**figures_of(summary), "failed": summary.requests["failed"], "routes": dict(summary.routes)}
        return RealPoint(rate, summary.goodput["fraction"], out_dir.name, figures)


def search(runner: Runner, workload: str, num_requests: int, slo: SLO, start_rate: float, factor: float,
           rel_tol: float, out_dir: Path) -> dict:
    """A measured saturation search; writes `saturation.json` into `out_dir` and returns it."""
    def evaluate(_option, rate: float) -> RealPoint:
        point = runner.run(workload, rate, num_requests, slo, out_dir / f"rate-{rate:.4g}")
        runner.log(f"  {workload} at {rate:.3g} req/s: {point.attainment:.0%} met the SLO "
                   f"(TTFT p50 {point.figures['ttft_p50_ms'] or 0:.0f} ms, failed {point.figures['failed']}, "
                   f"routes {point.figures['routes']})")
        return point

    found = saturation_rate(evaluate, None, start_rate, factor=factor, rel_tol=rel_tol)
    data = {"workload": workload, "num_requests": num_requests,
            "seed": _seed_of(out_dir / found.points[0].run),  # the simulated search draws with the first run's
            "slo": slo.as_dict(),
            "start_rate": start_rate, "factor": factor, "rel_tol": rel_tol, "rate": found.rate,
            "high": found.high, "capped": found.capped,
            "points": [{"rate": p.rate, "attainment": p.attainment, "meets": p.meets, "run": p.run,
                        "figures": p.figures} for p in found.points]}
    write_search(out_dir, data)
    return data


def _seed_of(run_dir: Path) -> int:
    return json.loads((run_dir / "summary.json").read_text())["env"]["seed"]
