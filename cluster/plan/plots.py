"""The planner's PNGs: goodput against the prefill:decode split, one line per routing
mode; and latency against rate for the recommended (or best) configuration, with the
requested rate and the SLO marked."""

from __future__ import annotations

from pathlib import Path

from cluster.loadtest.config import SLO
from cluster.loadtest.plots import _pyplot
from cluster.plan.evaluate import PlanPoint
from cluster.plan.search import PlanReport


def plot_split(report: PlanReport, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[str, dict[int, float]] = {}
    for p in report.points:
        if not p.option.disaggregated:
            ax.axhline(p.goodput_rps, color="grey", linestyle="--", label=f"colocated ({p.option.num_replicas})")
            continue
        label = p.option.mode if p.option.mode != "threshold" else "threshold (best of its thresholds)"
        best = lines.setdefault(label, {})
        best[p.option.num_prefill] = max(best.get(p.option.num_prefill, 0.0), p.goodput_rps)
    for label, by_prefill in sorted(lines.items()):
        xs = sorted(by_prefill)
        ax.plot(xs, [by_prefill[x] for x in xs], marker="o", label=label)
    if report.recommendation is not None and report.recommendation.option.disaggregated:
        rec = report.recommendation
        ax.plot([rec.option.num_prefill], [rec.goodput_rps], marker="*", markersize=16, color="black",
                linestyle="none", label=f"recommended: {rec.option.name}")
    ax.set_xlabel(f"prefill replicas (of {report.num_replicas})")
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax.set_title(f"{report.workload} at {report.rate:g} req/s: goodput by prefill:decode split")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rate_points(report: PlanReport) -> tuple[str, list[PlanPoint]]:
    """The recommended (or best) option's simulated rates, ascending."""
    anchor = report.recommendation or report.points[0]
    name = anchor.option.name
    sat = report.saturation.get(name)
    found = {p.rate: p for p in sat.points} if sat is not None else {}
    found[anchor.rate] = anchor
    for key, p in report.sensitivity.items():
        if key.startswith("rate_"):
            found[p.rate] = p
    return name, [found[r] for r in sorted(found)]


def plot_rate(report: PlanReport, slo: SLO, path: Path) -> Path:
    plt = _pyplot()
    name, points = rate_points(report)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = [p.rate for p in points]
    for ax, (key, label, limit, quantiles) in zip(axes, (("ttft_ms", "TTFT", slo.ttft_ms, ("p50", "p90", "p99")),
                                                         ("tpot_ms", "TPOT", slo.tpot_ms, ("p50", "p90"))), strict=True):
        for q in quantiles:
            ax.plot(rates, [getattr(p, key).get(q) for p in points], marker="o", label=f"{label} {q}")
        if limit is not None:
            ax.axhline(limit, color="red", linestyle=":", label=f"SLO {limit:g} ms")
        ax.axvline(report.rate, color="black", linestyle="--", label=f"planned {report.rate:g} req/s")
        sat = report.saturation_of(report.recommendation.option) if report.recommendation else None
        if sat:
            ax.axvline(sat, color="orange", linestyle="-.", label=f"saturation {sat:.3g} req/s")
        ax.set_yscale("log")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{name}: latency against rate ({report.workload})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
