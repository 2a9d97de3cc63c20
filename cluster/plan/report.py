"""What `pdcluster plan` hands back: the JSON report, a table, and the recommendation as
a cluster config that `pdcluster serve --config` accepts."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from cluster.config import SLO as ProfileSLO
from cluster.config import (
    ClusterConfig,
    EngineSettings,
    ModelConfig,
    PoolConfig,
    RouterSettings,
    load_config,
)
from cluster.loadtest.config import SLO
from cluster.plan.calibration import Calibration
from cluster.plan.evaluate import ATTAINMENT, PlanPoint
from cluster.plan.options import PlanOption
from cluster.plan.search import HEADROOM, PlanReport


def report_dict(report: PlanReport, slo: SLO, calibration: Calibration, calibration_path: str | None) -> dict:
    rec = report.recommendation
    return {
        "workload": report.workload, "rate": report.rate, "num_replicas": report.num_replicas,
        "slo": slo.as_dict(), "meets_slo_rule": f">= {ATTAINMENT:.0%} of requests meet both limits",
        "calibration": {"path": calibration_path, "model": calibration.model, "device": calibration.device,
                        "dtype": calibration.dtype, "source": calibration.source,
                        "engine_version": calibration.engine_version,
                        "step_fit_median_error": calibration.quality.median_relative_error},
        "configurations": [_with_saturation(p, report) for p in report.points],
        "recommendation": None if rec is None else {**_with_saturation(rec, report),
                                                    "rate_vs_saturation": _headroom(rec, report)},
        "no_recommendation_because": report.why_none,
        "sensitivity": {k: p.to_dict() for k, p in report.sensitivity.items()},
        "disaggregation": report.disaggregation,
        "replicas_needed": report.replicas_needed,
    }


def _with_saturation(p: PlanPoint, report: PlanReport) -> dict:
    s = report.saturation.get(p.option.name)
    extra = {} if s is None else {"saturation_rate": None if s.rate is None else round(s.rate, 4),
                                  "saturation_is_lower_bound": s.capped}
    return {**p.to_dict(), **extra}


def _headroom(p: PlanPoint, report: PlanReport) -> float | None:
    sat = report.saturation_of(p.option)
    return round(report.rate / sat, 4) if sat else None


def print_table(report: PlanReport, slo: SLO, limit: int = 15) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=170)  # a pipe or a file: no elision
    table = Table(title=f"{report.workload} at {report.rate:g} req/s on {report.num_replicas} replicas "
                        f"(SLO {slo.as_dict()}; ranked by goodput per replica)")
    table.add_column("config", no_wrap=True)
    for col in ("meets", "attain", "good/rep", "TTFT p50/90/99", "TPOT p50/90", "ITL p50/99", "util P/D", "sat"):
        table.add_column(col, justify="right", no_wrap=True)
    for p in report.points[:limit]:
        table.add_row(p.option.name + (" *" if p is report.recommendation else ""), "yes" if p.meets else "no",
                      f"{p.attainment:.0%}", f"{p.goodput_per_replica:.3f}", _ms(p.ttft_ms, ("p50", "p90", "p99")),
                      _ms(p.tpot_ms, ("p50", "p90")), _ms(p.itl_ms, ("p50", "p99")),
                      f"{p.utilisation.get('prefill', 0):.0%}/{p.utilisation.get('decode', 0):.0%}",
                      _sat(report, p))
    console.print(table)
    if len(report.points) > limit:
        console.print(f"({len(report.points) - limit} more in the JSON report)")
    for line in summary_lines(report):
        console.print(line)


def summary_lines(report: PlanReport) -> list[str]:
    lines = []
    rec = report.recommendation
    if rec is not None:
        sat = report.saturation_of(rec.option)
        lines.append(f"Recommended: {rec.option.name} ({rec.attainment:.0%} of requests meet the SLO; "
                     f"{report.rate:g} req/s is {report.rate / sat:.1%} of its saturation rate {sat:.3g} req/s).")
        sens = ", ".join(f"{k}: {p.attainment:.0%}{'' if p.meets else ' (misses)'}" for k, p in report.sensitivity.items())
        lines.append(f"Sensitivity (share meeting the SLO): {sens}.")
    else:
        best = report.points[0]
        lines.append(f"No recommendation: {report.why_none}. Best: {best.option.name} "
                     f"({best.attainment:.0%} meet the SLO).")
        needed = report.replicas_needed or {}
        for label in ("best", "colocated"):
            found = needed.get(label)
            if found:
                lines.append(f"  {found['config']} ({found['num_replicas']} replicas) would meet it at "
                             f"{needed['rate_checked']:g} req/s ({HEADROOM:.0%} headroom).")
    lines.append(report.disaggregation.get("sentence", ""))
    return lines


def _sat(report: PlanReport, p: PlanPoint) -> str:
    s = report.saturation.get(p.option.name)
    if s is None:
        return ""
    return "none" if s.rate is None else (">=" if s.capped else "") + f"{s.rate:.3g}"


def _ms(block: dict, keys: tuple[str, ...]) -> str:
    return "/".join("-" if block.get(k) is None else f"{block[k]:.0f}" for k in keys)


def cluster_config(option: PlanOption, slo: SLO, calibration: Calibration, model_path: str | None) -> ClusterConfig:
    """The option as a cluster config: its pools, the calibration's engine limits, and a
    default profile with its mode and the SLO."""
    limits = calibration.limits
    model = ModelConfig(path=model_path or calibration.model, dtype=_dtype(calibration.dtype))
    preset = PRESET_NAME.fullmatch(calibration.model)
    if model_path is None and preset is not None:  # an embedded model, as the default calibration names it
        model = ModelConfig(preset=preset["preset"], seed=int(preset["seed"]), dtype=_dtype(calibration.dtype))
    profile_slo = ProfileSLO(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms)
    return ClusterConfig(
        model=model,
        engine=EngineSettings(block_size=limits.block_size, max_num_seqs=limits.max_num_seqs,
                              max_num_batched_tokens=limits.max_num_batched_tokens,
                              enable_prefix_caching=limits.enable_prefix_caching),
        prefill=PoolConfig(num_replicas=option.num_prefill),
        decode=PoolConfig(num_replicas=option.num_decode),
        router=RouterSettings(default_slo=profile_slo),
        workloads={"default": option.profile(profile_slo)},
    )


PRESET_NAME = re.compile(r"(?P<preset>tiny|small)-seed(?P<seed>\d+)")  # as the default calibration names them


def _dtype(dtype: str) -> str:
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def write_config(config: ClusterConfig, path: Path, header: str) -> Path:
    data = config.model_dump(mode="json", exclude_defaults=True)
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # `pdcluster serve --config` reads it back the same way
    return path
