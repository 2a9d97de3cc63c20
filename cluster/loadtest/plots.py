"""PNG plots with matplotlib (imported here only, so the CLI starts fast): latency CDFs,
a run timeline, latency against rate for sweeps, and overlays for `compare`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cluster.loadtest.client import RequestRecord

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_values_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.ok]
    return {
        "ttft_ms": sorted(r.ttft_s * 1000 for r in done if r.ttft_s is not None),
        "tpot_ms": sorted(r.tpot_s * 1000 for r in done if r.tpot_s is not None),
        "itl_ms": sorted(g * 1000 for r in done for g in r.itl_s),
        "e2e_ms": sorted(r.e2e_s * 1000 for r in done if r.e2e_s is not None),
    }


def plot_cdfs(path: Path, runs: dict[str, Sequence[RequestRecord]]) -> Path:
    """One panel per latency, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, label) in zip(axes.flat, LATENCIES, strict=False):
        for name, records in runs.items():
            values = latency_values_ms(records)[key]
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_timeline(path: Path, records: Sequence[RequestRecord]) -> Path:
    """Per request: send time against TTFT and E2E (failures marked); below, requests in
    flight over time."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    top.scatter([r.sent_at_s for r in done], [r.e2e_s * 1000 for r in done], s=6, label="E2E")
    top.scatter([r.sent_at_s for r in done], [r.ttft_s * 1000 for r in done], s=6, label="TTFT")
    if failed:
        top.scatter([r.sent_at_s for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    top.set(ylabel="ms", title="latency by send time")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    events = sorted([(r.sent_at_s, 1) for r in records] + [(r.ended_at_s, -1) for r in records])
    times, level, levels = [], 0, []
    for t, step in events:
        level += step
        times.append(t)
        levels.append(level)
    bottom.step(times, levels, where="post")
    bottom.set(xlabel="seconds since start", ylabel="in flight")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_run(out_dir: Path, records: Sequence[RequestRecord]) -> list[Path]:
    return [plot_cdfs(out_dir / "latency_cdf.png", {"run": records}),
            plot_timeline(out_dir / "timeline.png", records)]


def plot_vs_rate(path: Path, points: Sequence[dict]) -> Path:
    """Sweep: p50/p99 TTFT and ITL (and achieved throughput) against the offered rate."""
    plt = _pyplot()
    points = sorted(points, key=lambda p: p["rate"])
    rates = [p["rate"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for stat in ("p50", "p99"):
            ax.plot(rates, [p[key][stat] for p in points], marker="o", label=f"{label} {stat}")
        ax.set(xlabel="offered rate (req/s)", ylabel="ms", title=f"{label} vs rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].plot(rates, [p["throughput_rps"] for p in points], marker="o", label="throughput")
    axes[2].plot(rates, [p["goodput_rps"] for p in points], marker="o", label="goodput")
    axes[2].plot(rates, rates, linestyle=":", color="grey", label="offered")
    axes[2].set(xlabel="offered rate (req/s)", ylabel="req/s", title="throughput vs rate")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_bars(path: Path, names: Sequence[str], metrics: dict[str, Sequence[float | None]]) -> Path:
    """`compare`: one small bar chart per metric, one bar per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 4))
    for ax, (label, values) in zip(axes if len(metrics) > 1 else [axes], metrics.items(), strict=False):
        ax.bar(range(len(names)), [v or 0.0 for v in values], color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
