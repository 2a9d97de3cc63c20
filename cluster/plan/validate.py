"""`pdcluster plan validate RUN_DIR...`: the simulator against what really happened.

Each run directory is replayed (`cluster/plan/replay.py`: the same requests at the same
offsets, the same cluster and routing) under the calibration fitted from the records of
every given run on the same deployment (or `--calibration FILE`), and its figures are set
beside the measured ones: TTFT p50/p90, ITL p50/p99, TPOT p50, throughput and goodput.

A directory holding `saturation.json` is a measured saturation search (`pdcluster bench
plan` writes them: one workload at rising rates, each run a directory inside): the
simulator runs the same search (the same start, the same steps, finer at the end) on the
same deployment and its saturation rate is set beside the measured one. When searches on
two or more deployments share a workload, the deployments are ranked by both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.config import SLO
from cluster.loadtest.metrics import Summary, summarize
from cluster.plan.calibrate import from_runs
from cluster.plan.calibration import Calibration
from cluster.plan.evaluate import AttainmentPoint
from cluster.plan.frontend_fit import fit_frontend
from cluster.plan.replay import RecordedRun, ReplayError, read_run, replay, sim_config
from cluster.plan.saturation import saturation_rate
from cluster.plan.sim.arrivals import at_rate
from cluster.plan.sim.frontend import Frontend, apply
from cluster.plan.sim.result import SimResult
from cluster.plan.sim.simulator import simulate

SATURATION_FILE = "saturation.json"
# (summary block, key) of each figure compared
FIGURES = {"ttft_p50_ms": ("ttft_ms", "p50"), "ttft_p90_ms": ("ttft_ms", "p90"), "itl_p50_ms": ("itl_ms", "p50"),
           "itl_p99_ms": ("itl_ms", "p99"), "tpot_p50_ms": ("tpot_ms", "p50"),
           "throughput_rps": ("throughput", "requests_per_s"), "goodput_rps": ("goodput", "requests_per_s"),
           "goodput_fraction": ("goodput", "fraction")}
SIM_REL_TOL = 0.02  # the simulated search bisects this much finer than a real one can afford
TIE = 0.05  # two saturation rates within this of each other rank as a tie


@dataclass(frozen=True)
class Search:
    """A measured saturation search: where it ran, how it stepped, what it found."""

    path: Path
    workload: str
    num_requests: int
    seed: int
    slo: SLO
    start_rate: float
    factor: float
    rel_tol: float
    rate: float | None  # the highest rate that met the SLO
    high: float | None  # the lowest rate that missed it
    points: list[dict]  # {"rate", "attainment", "meets", "run"}

    @property
    def runs(self) -> list[Path]:
        return [self.path / p["run"] for p in self.points]

    @property
    def estimate(self) -> float | None:
        return bracket_middle(self.rate, self.high)


def bracket_middle(low: float | None, high: float | None) -> float | None:
    """A saturation search's point estimate: the geometric middle of the highest rate that
    met the SLO and the lowest that missed it (the first alone when nothing missed)."""
    if low is None or high is None:
        return low
    return (low * high) ** 0.5


def read_search(path: Path) -> Search:
    d = json.loads((path / SATURATION_FILE).read_text())
    return Search(path, d["workload"], d["num_requests"], d["seed"], SLO(**d["slo"]), d["start_rate"], d["factor"],
                  d["rel_tol"], d["rate"], d.get("high"), d["points"])


def write_search(path: Path, search: dict) -> None:
    (path / SATURATION_FILE).write_text(json.dumps(search, indent=1) + "\n")


def figures_of(summary: Summary) -> dict[str, float | None]:
    data = summary.to_dict()
    return {name: data.get(block, {}).get(key) for name, (block, key) in FIGURES.items()}


def compare(measured: dict, predicted: dict) -> dict[str, dict]:
    """{figure: {"measured", "predicted", "error"}}; error = predicted / measured - 1."""
    return {name: {"measured": measured.get(name), "predicted": _round(predicted.get(name)),
                   "error": relative_error(predicted.get(name), measured.get(name))} for name in measured}


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return round(predicted / measured - 1.0, 4)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def validate(paths: Sequence[str | Path], calibration: Calibration | None = None,
             log: Callable[[str], None] = lambda _: None) -> dict:
    """Replay every run and re-run every search; `{"runs", "searches", "rankings",
    "calibrations"}`."""
    runs, searches = _collect(paths)
    by_key: dict[str, list[RecordedRun]] = {}
    for run in runs.values():
        by_key.setdefault(run.deployment.key, []).append(run)
    in_searches = {p for s in searches for p in s.runs}
    calibrations, simulated = {}, {}
    for key, group in by_key.items():
        base = calibration or _calibrate(group, log)
        simulated |= {run.path: replay(run, base) for run in group}  # the engines do not see the serving path
        fit_on = [r for r in group if r.path in in_searches] or group
        calibrations[key] = base if calibration else _with_frontend(base, [(r, simulated[r.path].records)
                                                                           for r in fit_on])
    replays = [replay_one(run, calibrations[run.deployment.key], simulated[path], log) for path, run in runs.items()]
    search_results = [search_one(s, runs[s.runs[0]], calibrations[runs[s.runs[0]].deployment.key], log)
                      for s in searches]
    return {"runs": replays, "searches": search_results, "rankings": rankings(search_results),
            "calibrations": {group[0].deployment.name: _describe(calibrations[key])
                             for key, group in by_key.items()}}


def _collect(paths: Sequence[str | Path]) -> tuple[dict[Path, RecordedRun], list[Search]]:
    runs: dict[Path, RecordedRun] = {}
    searches: list[Search] = []
    for given in paths:
        path = Path(given)
        if (path / SATURATION_FILE).exists():
            search = read_search(path)
            searches.append(search)
            for run_dir in search.runs:
                runs[run_dir] = read_run(run_dir)
        else:
            runs[path] = read_run(path)
    if not runs:
        raise ReplayError("no run directories given")
    return runs, searches


def _calibrate(group: list[RecordedRun], log: Callable[[str], None]) -> Calibration:
    log(f"calibrating {group[0].deployment.name} from the records of its {len(group)} runs")
    return from_runs([r.path for r in group])


def _with_frontend(calibration: Calibration, replayed: list) -> Calibration:
    """The serving path's queue fitted to the client latencies of `replayed` (a search's
    runs when there is one, so the runs judged apart from it are not the ones it was
    fitted on)."""
    frontend, loss = fit_frontend(replayed)
    note = (f"serving path: {frontend.request_s * 1e3:g} ms a request, {frontend.chunk_s * 1e3:g} ms a chunk, "
            f"fitted to the client latencies of {len(replayed)} runs (mean squared log error {loss:.3f})")
    return calibration.model_copy(update={"frontend_request_s": frontend.request_s,
                                          "frontend_chunk_s": frontend.chunk_s,
                                          "notes": f"{calibration.notes}; {note}"})


def frontend_of(calibration: Calibration) -> Frontend:
    return Frontend(calibration.frontend_request_s or 0.0, calibration.frontend_chunk_s or 0.0)


def _summary(result: SimResult, slo: SLO, rate: float | None, calibration: Calibration) -> Summary:
    """The simulated run as its client would have summarised it (through the serving path)."""
    records = apply(result.records, frontend_of(calibration))
    return summarize(records, slo, rate, {"simulated": True, "stream": True})


def replay_one(run: RecordedRun, calibration: Calibration, result: SimResult, log: Callable[[str], None]) -> dict:
    """`run` against its replay `result` under `calibration`."""
    summary = _summary(result, run.slo, run.target_rate, calibration)
    predicted = figures_of(summary)
    row = {"run": str(run.path), "deployment": run.deployment.name, "workload": run.load.workload,
           "mode": run.mode, "rate": run.target_rate, "num_requests": len(run.records),
           "figures": compare(figures_of(run.summary), predicted),
           "routes": {"measured": dict(run.summary.routes), "predicted": dict(summary.routes)},
           "sim_wall_s": round(result.wall_s, 3)}
    f = row["figures"]
    log(f"{run.path}: TTFT p50 {_pair(f['ttft_p50_ms'])}, ITL p50 {_pair(f['itl_p50_ms'])}, "
        f"TPOT p50 {_pair(f['tpot_p50_ms'])}")
    return row


def _pair(figure: dict) -> str:
    m, p = figure["measured"], figure["predicted"]
    return "n/a" if m is None or p is None else f"{m:.1f} measured / {p:.1f} predicted"


def search_one(search: Search, run: RecordedRun, calibration: Calibration, log: Callable[[str], None]) -> dict:
    """The simulated twin of a measured search: same deployment, workload, request count,
    start and step; bisected to `SIM_REL_TOL`."""
    config = sim_config(run, seed=search.seed)

    def evaluate(_option, rate: float) -> AttainmentPoint:
        arrivals = at_rate(search.workload, rate, search.num_requests, search.seed)
        result = simulate(config, calibration, arrivals, target_rate=rate)
        summary = _summary(result, search.slo, rate, calibration)
        return AttainmentPoint(rate, summary.goodput["fraction"])

    found = saturation_rate(evaluate, None, search.start_rate, factor=search.factor,
                            rel_tol=min(SIM_REL_TOL, search.rel_tol))
    measured = search.estimate
    row = {"search": str(search.path), "deployment": run.deployment.name, "workload": search.workload,
           "slo": search.slo.as_dict(), "mode": run.mode,
           "measured": {"rate": search.rate, "high": search.high, "estimate": _round(measured),
                        "points": [{k: p[k] for k in ("rate", "attainment", "meets")} for p in search.points]},
           "predicted": {"rate": _round(found.rate), "high": _round(found.high), "capped": found.capped,
                         "points": [{"rate": round(p.rate, 4), "attainment": round(p.attainment, 4)}
                                    for p in found.points]},
           "error": relative_error(found.rate, measured)}
    log(f"{search.path}: saturation {measured} req/s measured, {found.rate} predicted")
    return row


def rankings(searches: Sequence[dict]) -> dict[str, dict]:
    """Per workload searched on two or more deployments: both orders by saturation rate,
    and whether they agree (rates within `TIE` of each other tie, and a tie agrees with
    either order)."""
    by_workload: dict[str, list[dict]] = {}
    for s in searches:
        by_workload.setdefault(s["workload"], []).append(s)
    out = {}
    for workload, group in by_workload.items():
        if len({s["deployment"] for s in group}) < 2:
            continue
        measured = {s["deployment"]: s["measured"]["estimate"] or 0.0 for s in group}
        predicted = {s["deployment"]: s["predicted"]["rate"] or 0.0 for s in group}
        out[workload] = {"measured": _order(measured), "predicted": _order(predicted),
                         "agree": orders_agree(measured, predicted)}
    return out


def _order(rates: dict[str, float]) -> list[str]:
    return sorted(rates, key=lambda k: -rates[k])


def orders_agree(measured: dict[str, float], predicted: dict[str, float], tie: float = TIE) -> bool:
    """Every pair ordered the same way, unless either side has it as a tie."""
    names = list(measured)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if _tied(measured[a], measured[b], tie) or _tied(predicted[a], predicted[b], tie):
                continue
            if (measured[a] > measured[b]) != (predicted[a] > predicted[b]):
                return False
    return True


def _tied(x: float, y: float, tie: float) -> bool:
    return abs(x - y) <= tie * max(x, y)


def _describe(c: Calibration) -> dict:
    return {"model": c.model, "device": c.device, "source": c.source,
            "held_out_median_error": round(c.quality.median_relative_error, 4),
            "held_out_work_median_error": _round(c.quality.work_median_relative_error),
            "run_wait_share": _round(c.quality.run_wait_share),
            "same_shape_spread": _round(c.quality.same_shape_spread),
            "num_step_records": c.quality.num_fitted + c.quality.num_held_out,
            "request_overhead_ms": round(c.request_overhead_s * 1e3, 3),
            "frontend_ms": {"request": _ms(c.frontend_request_s), "chunk": _ms(c.frontend_chunk_s)},
            "notes": c.notes}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)
