"""The experiment's pictures: per-arm bars with their spread over repeats, and latency CDFs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cluster.experiment.analysis import arms
from cluster.experiment.runner import Experiment

BARS = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p90_ms", "TTFT p90 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
        ("goodput_fraction", "goodput (fraction)"))


def write_plots(exp: Experiment, analysis: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload, found in analysis.items():
        names = list(found["arms"])
        fig, axes = plt.subplots(1, len(BARS), figsize=(4 * len(BARS), 3.4))
        for ax, (metric, label) in zip(axes, BARS, strict=True):
            values = [found["arms"][n]["metrics"][metric]["value"] for n in names]
            lows = [found["arms"][n]["metrics"][metric]["spread"][0] for n in names]
            highs = [found["arms"][n]["metrics"][metric]["spread"][1] for n in names]
            err = np.array([[max(0.0, v - lo) for v, lo in zip(values, lows, strict=True)],
                            [max(0.0, hi - v) for v, hi in zip(values, highs, strict=True)]])
            ax.bar(names, values, yerr=np.nan_to_num(err), capsize=4, color="#4c72b0")
            ax.set_title(label, fontsize=10)
            ax.tick_params(axis="x", rotation=30)
        fig.suptitle(f"{workload}: pooled over repeats; bars span the repeats' lowest to highest")
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"bars-{workload}.png"))
        written.append(_cdfs(plt, exp, workload, out_dir))
    return written


def _cdfs(plt, exp: Experiment, workload: str, out_dir: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, runs in arms(exp, workload).items():
        for ax, get in zip(axes, (lambda r: r.ttft_s, lambda r: r.e2e_s), strict=True):
            values = np.sort([get(rec) * 1000.0 for run in runs for rec in run.records if rec.ok and get(rec)])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
    for ax, label in zip(axes, ("TTFT (ms)", "E2E (ms)"), strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{workload}: latency CDFs per arm")
    fig.tight_layout()
    return _save(fig, out_dir / f"cdf-{workload}.png")


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
