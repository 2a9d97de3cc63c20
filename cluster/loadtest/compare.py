"""`pdcluster compare DIR...`: the same metrics of several runs side by side, each with its
ratio to the first run, plus overlaid latency CDFs and bar charts — the report that says
which of local, disagg and auto serves one workload better."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from cluster.loadtest.metrics import Summary
from cluster.loadtest.report import read_records, read_summary, write_csv

# (label, path into summary.json, lower is better)
METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("completed", ("requests", "completed"), False),
    ("failed", ("requests", "failed"), True),
    ("achieved rate (req/s)", ("rate", "achieved"), False),
    ("throughput (req/s)", ("throughput", "requests_per_s"), False),
    ("output tok/s", ("throughput", "output_tokens_per_s"), False),
    ("goodput (req/s)", ("goodput", "requests_per_s"), False),
    ("goodput fraction", ("goodput", "fraction"), False),
    *((f"{name} {stat} (ms)", (f"{name}_ms", stat), True)
      for name in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "p50", "p99")),
    ("routes disagg", ("routes", "disagg"), False),
    ("routes local", ("routes", "local"), False),
)
# Rows kept only where some run has a value (servers that send x-pd-predicted-*-ms).
PREDICTION_METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = tuple(
    (f"{figure} prediction MAPE {route}", ("prediction_error", route, f"{figure}_mape"), True)
    for route in ("local", "disagg") for figure in ("ttft", "tpot"))


def _get(data: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _row(metric: tuple[str, tuple[str, ...], bool], data: Sequence[dict]) -> dict:
    label, path, lower_better = metric
    values = [_get(d, path) for d in data]
    first = values[0]
    ratios = [None if v is None or not first else round(v / first, 4) for v in values]
    return {"metric": label, "values": values, "ratios": ratios, "lower_is_better": lower_better}


def run_names(dirs: Sequence[Path], summaries: Sequence[Summary]) -> list[str]:
    """The folder name, with the `--mode` when the run had one and the name lacks it."""
    names = []
    for d, s in zip(dirs, summaries, strict=False):
        name, mode = Path(d).name, s.env.get("mode")
        names.append(name if not mode or mode in name else f"{name} ({mode})")
    return names


def compare(dirs: Sequence[str | Path], out: str | Path) -> dict:
    """Write `out/compare.json`, `compare.csv`, `latency_cdf.png`, `metrics.png`; return
    `{"runs": [...], "rows": [{"metric", "values", "ratios", "lower_is_better"}]}` where
    ratios are each value over the first run's (None where undefined)."""
    dirs = [Path(d) for d in dirs]
    if not dirs:
        raise ValueError("compare needs at least one run folder")
    for d in dirs:
        if not (d / "summary.json").exists():
            raise ValueError(f"{d} has no summary.json (not a loadtest output folder)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [read_summary(d) for d in dirs]
    names = run_names(dirs, summaries)
    data = [s.to_dict() for s in summaries]
    rows = [_row(metric, data) for metric in METRICS]
    rows += [row for row in (_row(metric, data) for metric in PREDICTION_METRICS)
             if any(v is not None for v in row["values"])]
    result = {"runs": names, "dirs": [str(d) for d in dirs], "rows": rows}
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    write_csv(out / "compare.csv", [{"metric": r["metric"], **dict(zip(names, r["values"], strict=False)),
                                     **{f"{n} / {names[0]}": x for n, x in zip(names, r["ratios"], strict=False)}} for r in rows])
    _plots(out, dirs, names, rows)
    return result


def _plots(out: Path, dirs: list[Path], names: list[str], rows: list[dict]) -> None:
    from cluster.loadtest.plots import plot_bars, plot_cdfs

    plot_cdfs(out / "latency_cdf.png", {n: read_records(d) for n, d in zip(names, dirs, strict=False)})
    wanted = ("throughput (req/s)", "goodput (req/s)", "ttft p50 (ms)", "ttft p99 (ms)", "tpot p50 (ms)", "e2e p99 (ms)")
    by_label = {r["metric"]: r["values"] for r in rows}
    plot_bars(out / "metrics.png", names, {label: by_label[label] for label in wanted})


def compare_table(result: dict):
    """A rich table: one column per run; after the first, `value (×ratio)`."""
    from rich.table import Table

    table = Table(title="compare (ratios against the first run)", title_justify="left")
    table.add_column("metric")
    for name in result["runs"]:
        table.add_column(name, justify="right")
    for row in result["rows"]:
        cells = []
        for i, (value, ratio) in enumerate(zip(row["values"], row["ratios"], strict=False)):
            text = "-" if value is None else (f"{value:,.2f}" if isinstance(value, float) else str(value))
            if i and ratio is not None:
                better = (ratio < 1) == row["lower_is_better"] and ratio != 1
                text += f" ([{'green' if better else 'red' if ratio != 1 else 'default'}]×{ratio:.2f}[/])"
            cells.append(text)
        table.add_row(row["metric"], *cells)
    return table
