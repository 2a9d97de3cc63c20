"""`pdcluster demo` (what `make demo` runs): one prefill and one decode replica on a local
Ray, the interference workload in modes `local`, `disagg` and `auto`, then the
side-by-side table and PNGs of `pdcluster compare`, then a clean stop.

The workload (`cluster.local.traffic.INTERFERENCE`): short-prompt streams arrive as a
Poisson process and decode while a long prompt arrives every few seconds. `local` makes
each replica prefill its own long prompts beside its streams (they stall); `disagg` sends
every prompt, short ones too, through the prefill replica; `auto` sends only the long
ones there. The full comparison on equal cores is `pdcluster bench cluster`.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

DEMO_APP = "pdcluster-demo"
MODES = ("local", "disagg", "auto")
# The rows of the demo's table (labels of `cluster.loadtest.compare.METRICS`).
TABLE_ROWS = ("completed", "failed", "ttft p50 (ms)", "ttft p99 (ms)", "itl p50 (ms)", "itl p99 (ms)",
              "tpot p50 (ms)", "routes disagg", "routes local")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)


def demo_cmd(
    out: Path = typer.Option(Path("runs/demo"), "--out", help="Folder for each mode's report and the comparison."),
    preset: str = typer.Option("small", help="Embedded model preset (tiny, small)."),
    model_cache: str | None = typer.Option(None, help="Where the preset is made once (default ~/.cache/pdcluster)."),
    quick: bool = typer.Option(False, "--quick", help="A smaller workload (smoke tests); pair with --preset tiny."),
) -> None:
    """Serve 1 prefill + 1 decode replica locally, A/B the routing modes on an interference load."""
    from rich.console import Console

    console = Console(log_path=False)
    started = time.perf_counter()
    try:
        result = run_demo(out, preset, model_cache, quick, console)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]demo failed:[/] {e}")
        raise typer.Exit(1) from None
    print_result(result, console)
    console.print(f"demo finished in {time.perf_counter() - started:.0f} s")


def demo_workload(quick: bool):
    from cluster.local.traffic import INTERFERENCE

    return INTERFERENCE.scaled(request_factor=0.35, prompt_factor=0.5, rate_factor=2.0) if quick else INTERFERENCE


def run_demo(out: Path, preset: str, model_cache: str | None, quick: bool, console) -> dict:
    """Deploy, run the three modes, compare; always stops Serve and Ray."""
    from cluster.loadtest.compare import compare
    from cluster.local.apps import app_args, ensure_preset, expected_pools
    from cluster.local.ray_cluster import LocalCluster
    from cluster.local.runs import run_workload, warm_up

    workload = demo_workload(quick)
    for line in workload.describe():
        console.print(line, highlight=False)
    runs = {}
    with LocalCluster(log=console.log) as cluster:
        with console.status(f"making the {preset} model (first use only) ..."):
            ensure_preset(preset, model_cache, console.log)
        with console.status("deploying 1 prefill + 1 decode replica (1 torch thread each) ..."):
            url = cluster.deploy(DEMO_APP, app_args(preset, model_cache, 1, 1), "/", expected_pools(1, 1))
        console.log(f"serving at {url}")
        with console.status("warming up (first KV transfer, first shapes) ..."):
            warm_up(url, MODES)
        for i, mode in enumerate(MODES):
            console.log(f"[bold]{workload.name}[/] with x-pd-mode: {mode}")
            run = run_workload(url, workload, mode, out / mode, seed=1000 + i, progress=True, plots=True)
            s = run.summary
            console.log(f"  {s.requests['completed']} done, {s.requests['failed']} failed; "
                        f"TTFT p50 {s.ttft_ms['p50']:.0f} ms, ITL p99 {s.itl_ms['p99']:.0f} ms, "
                        f"routes {s.routes}")
            runs[mode] = run
    with console.status("comparing ..."):
        result = compare([out / m for m in MODES], out / "compare")
    result["by_class"] = {m: r.by_class for m, r in runs.items()}
    result["figures"] = {m: r.figures() for m, r in runs.items()}
    result["out"] = str(out / "compare")
    return result


def print_result(result: dict, console) -> None:
    from rich.table import Table

    from cluster.loadtest.compare import compare_table

    shown = dict(result, rows=[r for r in result["rows"] if r["metric"] in TABLE_ROWS])
    console.print(compare_table(shown))
    table = Table(title="per request class, and goodput (each request against its class's SLO)",
                  title_justify="left")
    table.add_column("figure")
    for name in result["runs"]:
        table.add_column(name, justify="right")
    by_class = result["by_class"]
    for cls, key, stat in (("short", "itl_ms", "p99"), ("short", "ttft_ms", "p50"), ("long", "ttft_ms", "p50")):
        values = [by_class[m].get(cls, {}).get(key, {}).get(stat) for m in by_class]
        table.add_row(f"{cls} {key[:-3]} {stat} (ms)", *("-" if v is None else f"{v:,.1f}" for v in values))
    for key, label in (("goodput_rps", "goodput (req/s)"), ("goodput_fraction", "goodput fraction")):
        values = [result["figures"][m][key] for m in result["figures"]]
        table.add_row(label, *("-" if v is None else f"{v:.3f}" for v in values))
    console.print(table)
    out = Path(result["out"])
    console.print(f"PNG: {out / 'metrics.png'} and {out / 'latency_cdf.png'}; table: {out / 'compare.csv'}")
