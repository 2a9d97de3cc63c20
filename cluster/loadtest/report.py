"""Files and console output of a run: summary.json, requests.jsonl, summary.csv, the
plots, a rich table, and a live progress bar."""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Sequence
from pathlib import Path

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.metrics import Summary

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STAT_KEYS = ("mean", "p50", "p90", "p95", "p99", "max")


def write_report(out_dir: Path, summary: Summary, records: Sequence[RequestRecord], plots: bool = True) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2, default=str) + "\n")
    with open(out_dir / "requests.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(_ms_row(record)) + "\n")
    write_csv(out_dir / "summary.csv", [flatten(summary)])
    if plots:
        from cluster.loadtest.plots import plot_run

        plot_run(out_dir, records)
    return out_dir


def _ms_row(record: RequestRecord) -> dict:
    """One requests.jsonl line: seconds become milliseconds, named `*_ms`."""
    row = {}
    for key, value in record.to_json().items():
        if key.endswith("_s"):
            key = key[:-2] + "_ms"
            if isinstance(value, list):
                value = [round(v * 1000.0, 4) for v in value]
            elif value is not None:
                value = round(value * 1000.0, 4)
        row[key] = value
    return row


def read_records(run_dir: Path) -> list[RequestRecord]:
    records = []
    for line in (Path(run_dir) / "requests.jsonl").read_text().splitlines():
        row = json.loads(line)
        seconds = {
            (k[:-3] + "_s"): (None if v is None else ([x / 1000.0 for x in v] if isinstance(v, list) else v / 1000.0))
            for k, v in row.items() if k.endswith("_ms")
        }
        records.append(RequestRecord.from_json({**row, **seconds}))
    return records


def read_summary(run_dir: Path) -> Summary:
    return Summary.from_dict(json.loads((Path(run_dir) / "summary.json").read_text()))


def flatten(summary: Summary) -> dict:
    """One CSV row: nested keys joined with dots; `env` reduced to a few identifying fields."""
    data = summary.to_dict()
    env = data.pop("env")
    row = {f"env.{k}": env.get(k) for k in ("target", "workload", "seed", "mode", "endpoint")}
    row["env.load"] = json.dumps(env.get("load"))

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            row[prefix] = value

    walk("", data)
    return row


def write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:,.2f}"
    return str(value)


def summary_table(summary: Summary, title: str = "load test"):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for stat in STAT_KEYS:
        table.add_column(stat, justify="right")
    for key in LATENCY_KEYS:
        block = getattr(summary, key)
        table.add_row(key, *(_fmt(block.get(stat)) for stat in STAT_KEYS))
    return table


def summary_lines(summary: Summary) -> list[str]:
    s = summary
    target = s.rate["target"]
    lines = [
        f"requests: {s.requests['completed']} completed, {s.requests['failed']} failed in {s.duration_s:.2f} s",
        f"rate: target {_fmt(target)}/s"
        + (f" (this seed's schedule: {_fmt(s.env['schedule_rate'])}/s)" if s.env.get("schedule_rate") else "")
        + f", achieved {_fmt(s.rate['achieved'])}/s",
        f"throughput: {_fmt(s.throughput['requests_per_s'])} req/s, "
        f"{_fmt(s.throughput['output_tokens_per_s'])} output tok/s, {_fmt(s.throughput['total_tokens_per_s'])} total tok/s",
        f"goodput: {_fmt(s.goodput['requests_per_s'])} req/s ({100 * s.goodput['fraction']:.1f}% of requests) "
        f"for SLO {s.goodput['slo'] or 'none'}",
        f"routes: {', '.join(f'{k} {v}' for k, v in s.routes.items())}",
    ]
    if s.errors:
        lines.append(f"errors: {', '.join(f'{k} {v}' for k, v in sorted(s.errors.items()))}")
    lag = (s.env.get("client_loop_lag_ms") or {}).get("p99")
    if lag is not None and lag > 20:
        lines.append(f"warning: the load generator was short of CPU (event-loop lag p99 {lag:.0f} ms); its latencies "
                     "may read high by about that much: try --clients K or a quieter machine")
    sweep = s.env.get("sweep")
    if sweep:
        lines.append(f"sweep: saturation {_fmt(sweep['saturation_rps'])} req/s, highest rate meeting the SLO "
                     f"{_fmt(sweep['max_rate_meeting_slo'])} req/s")
    return lines


def prediction_table(summary: Summary):
    """Per route, the router's prediction error (see predictions.py); None without predictions."""
    from rich.table import Table

    if not summary.prediction_error:
        return None
    table = Table(title="router predictions (medians; MAPE |error| / measured, bias measured / predicted)",
                  title_justify="left")
    table.add_column("route")
    for figure in ("TTFT", "TPOT"):
        for label in ("MAPE", "bias", "n"):
            table.add_column(f"{figure} {label}", justify="right")
    for route, block in summary.prediction_error.items():
        cells = []
        for figure in ("ttft", "tpot"):
            mape = block.get(f"{figure}_mape")
            cells += ["-"] * 3 if mape is None else [
                f"{100 * mape:.1f}%", f"×{block[f'{figure}_bias']:.2f}", str(block[f"{figure}_samples"])]
        table.add_row(route, *cells)
    return table


def print_summary(summary: Summary, title: str = "load test", console=None) -> None:
    from rich.console import Console

    console = console or Console()
    console.print(summary_table(summary, title))
    predictions = prediction_table(summary)
    if predictions is not None:
        console.print(predictions)
    for line in summary_lines(summary):
        console.print(line, highlight=False)


class LiveProgress:
    """A rich progress bar with live figures: completed, failed, in-flight-free p50 TTFT."""

    def __init__(self, total: int | None, duration_s: float | None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.started = time.perf_counter()
        self.ttfts: list[float] = []
        self.failed = 0
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[live]}"),
                                 TimeElapsedColumn(), transient=True)
        self.task = self.progress.add_task("load", total=total, live="")
        self.progress.start()

    def update(self, record: RequestRecord) -> None:
        if record.ok and record.ttft_s is not None:
            self.ttfts.append(record.ttft_s)
        self.failed += not record.ok
        done = len(self.ttfts) + self.failed
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        p50 = sorted(self.ttfts)[len(self.ttfts) // 2] * 1000.0 if self.ttfts else float("nan")
        live = f"{done} done, {self.failed} failed, {done / elapsed:.1f} req/s, TTFT p50 {p50:.0f} ms"
        self.progress.update(self.task, advance=1, live=live)

    def close(self) -> None:
        self.progress.stop()
