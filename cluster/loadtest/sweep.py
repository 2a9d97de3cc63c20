"""`--sweep`: measure the saturation throughput with a closed loop, then offer open-loop
rates up to and past it, and bisect for the highest rate whose goodput meets the SLO.

Reports both: `saturation_rps` (the most requests per second the server completed) and
`max_rate_meeting_slo` (the highest offered rate at which at least `slo_attainment` of the
requests met every SLO; null without an SLO). Every point is bounded by the run's count or
duration, so a sweep takes at most (points + 3) times one run.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.metrics import Summary, summarize
from cluster.loadtest.runner import build_plan
from cluster.loadtest.session import environment, open_session, run_plan

BISECT_STEPS = 2
OVERLOAD_FACTOR = 1.25  # one point past saturation, so the knee shows on the plots


def _point(config: LoadTestConfig, session, rate: float | None, concurrency: int | None, name: str):
    point_config = replace(config, sweep=False, rate=rate, concurrency=concurrency, progress=False,
                           out_dir=None if config.out_dir is None else Path(config.out_dir) / "points" / name)
    plan = build_plan(point_config)
    lags: list[float] = []
    records = run_plan(point_config, session, plan, loop_lags_s=lags)
    summary = summarize(records, config.slo, plan.target_rate, environment(point_config, session, plan, records, lags))
    if point_config.out_dir is not None:
        from cluster.loadtest.report import write_report

        write_report(point_config.out_dir, summary, records, plots=False)
    return summary, records


def _row(rate: float, summary: Summary, config: LoadTestConfig) -> dict:
    return {
        "rate": round(rate, 4),
        "achieved_rate": summary.rate["achieved"],
        "throughput_rps": summary.throughput["requests_per_s"],
        "goodput_rps": summary.goodput["requests_per_s"],
        "goodput_fraction": summary.goodput["fraction"],
        "meets_slo": bool(config.slo.as_dict()) and summary.goodput["fraction"] >= config.slo_attainment,
        **{k: getattr(summary, k) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }


def run_sweep(config: LoadTestConfig) -> Summary:
    session = open_session(config)
    saturation, _ = _point(config, session, None, config.sweep_max_concurrency, "saturation")
    saturation_rps = saturation.throughput["requests_per_s"]
    if saturation_rps <= 0:
        raise RuntimeError("sweep: the saturation run completed no requests")
    rates = [saturation_rps * k / config.sweep_points for k in range(1, config.sweep_points + 1)]
    rates.append(saturation_rps * OVERLOAD_FACTOR)
    results: dict[float, tuple[Summary, list]] = {}
    for rate in rates:
        results[rate] = _point(config, session, rate, None, f"rate_{rate:.3f}")
    rows = {rate: _row(rate, s, config) for rate, (s, _) in results.items()}
    for _ in range(BISECT_STEPS if config.slo.as_dict() else 0):
        good = [r for r in rows if rows[r]["meets_slo"]]
        bad = [r for r in rows if not rows[r]["meets_slo"] and (not good or r > max(good))]
        if not bad:
            break
        low, high = (max(good) if good else 0.0), min(bad)
        rate = (low + high) / 2
        results[rate] = _point(config, session, rate, None, f"rate_{rate:.3f}")
        rows[rate] = _row(rate, results[rate][0], config)
    good = [r for r in rows if rows[r]["meets_slo"]]
    best = max(good) if good else max(rows)
    sweep = {
        "saturation_rps": saturation_rps,
        "max_rate_meeting_slo": round(max(good), 4) if good else None,
        "slo_attainment": config.slo_attainment,
        "points": [rows[r] for r in sorted(rows)],
    }
    summary, records = results[best]
    summary.env["sweep"] = sweep
    summary.env["load"] = config.describe_shape()
    if config.out_dir is not None:
        _write(Path(config.out_dir), summary, records, sweep, config.plots)
    return summary


def _write(out_dir: Path, summary: Summary, records, sweep: dict, plots: bool) -> None:
    from cluster.loadtest.report import write_report

    write_report(out_dir, summary, records, plots=plots)
    (out_dir / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    if plots:
        from cluster.loadtest.plots import plot_vs_rate

        plot_vs_rate(out_dir / "sweep_vs_rate.png", sweep["points"])
