"""`pdcluster plan`'s work: simulate every configuration of N replicas for one workload,
rate and SLO, and write what it found (table, JSON, PNGs, a cluster config)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.config import SLO
from cluster.plan.calibration import Calibration
from cluster.plan.evaluate import Evaluator, PlanPoint, Workload, save_points
from cluster.plan.options import plan_options
from cluster.plan.plots import plot_rate, plot_split
from cluster.plan.report import (
    cluster_config,
    print_table,
    report_dict,
    summary_lines,
    write_config,
)
from cluster.plan.search import PlanReport, run_plan


@dataclass(frozen=True)
class PlanArgs:
    workload: Workload
    rate: float
    slo: SLO
    num_replicas: int
    rate_sweep: bool = False
    replicas_per_node: int = 8
    model_path: str | None = None  # written into the recommended config; default: the calibration's model
    out: Path | None = None
    as_json: bool = False


def plan(args: PlanArgs, calibration: Calibration, calibration_path: str | None = None,
         log: Callable[[str], None] = lambda _: None) -> dict:
    """Run the search and write its outputs; returns the JSON report."""
    if args.rate <= 0 or args.num_replicas < 1:
        raise ValueError("--rate must be > 0 and --replicas at least 1")
    started = time.perf_counter()
    options = plan_options(args.num_replicas)
    with _progress(not args.as_json) as advance:
        evaluate = Evaluator(calibration, args.workload, args.slo, args.replicas_per_node, on_point=advance)
        report = run_plan(evaluate, args.rate, args.num_replicas, args.rate_sweep, options, log)
    data = report_dict(report, args.slo, calibration, calibration_path)
    data["summary"] = summary_lines(report)
    data["run_time_s"] = round(time.perf_counter() - started, 2)
    if args.out is not None:
        data["files"] = _write(args, report, calibration, data)
    if not args.as_json:
        print_table(report, args.slo)
    return data


def _write(args: PlanArgs, report: PlanReport, calibration: Calibration, data: dict) -> dict[str, str]:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    files = {"report": out / "plan.json", "points": out / "points.jsonl", "split_plot": out / "goodput_by_split.png",
             "rate_plot": out / "latency_by_rate.png"}
    save_points(report.points, files["points"])
    plot_split(report, files["split_plot"])
    plot_rate(report, args.slo, files["rate_plot"])
    chosen = report.recommendation or report.points[0]
    files["config"] = out / ("recommended.yaml" if report.recommendation else "best_not_meeting_slo.yaml")
    config = cluster_config(chosen.option, args.slo, calibration, args.model_path)
    header = (f"pdcluster plan: {chosen.option.name} for {args.workload.name} at {args.rate:g} req/s, "
              f"SLO {args.slo.as_dict()}\n" + "\n".join(summary_lines(report)))
    if config.model.path is not None and not Path(config.model.path).is_absolute():
        header += (f"\nmodel.path is the calibration's model name ({config.model.path}): point it at the model "
                   "folder, or plan with --model-path")
    write_config(config, files["config"], header)
    named = {k: str(v) for k, v in files.items()}
    files["report"].write_text(json.dumps({**data, "files": named}, indent=2) + "\n")
    return named


class _progress:
    """A rich progress line per simulated configuration (no total: the search decides
    how many); nothing when printing JSON."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = None

    def __enter__(self) -> Callable[[PlanPoint], None]:
        if not self.enabled:
            return lambda _: None
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} runs"),
                                  TimeElapsedColumn(), transient=True)
        self._progress.start()
        task = self._progress.add_task("simulating", total=None)

        def advance(point: PlanPoint) -> None:
            self._progress.update(task, advance=1,
                                  description=f"{point.option.name} at {point.rate:.3g} req/s: "
                                              f"{point.attainment:.0%} meet the SLO")
        return advance

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
