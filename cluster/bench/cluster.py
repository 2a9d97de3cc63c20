"""`pdcluster bench cluster --json`: colocated vs disaggregated vs `auto` on equal cores.

Two apps are deployed side by side on one local Ray, each with two single-threaded
engine replicas and the same engine settings:

- `colocated` (`/colocated`): 2 decode replicas, profile `local`: every request is
  prefilled and decoded on one replica, the router balancing by load.
- `pd` (`/pd`): 1 prefill + 1 decode replica; `x-pd-mode: disagg` prefills every request
  remotely, `x-pd-mode: auto` lets the router decide per request.

Three workloads (`cluster.bench.sizing`: rates and SLOs sized to this machine) run in
every configuration, repeated, interleaved (configuration order rotated each repeat),
each run with fresh prompt bytes; results are medians over repeats. Then the router's
own TTFT cost is measured against calling the decode deployment through a Serve handle.
`--workloads` re-runs a subset (ratios only for what ran); `--overhead-samples 0` skips
the router-overhead part.
Progress goes to stderr, the JSON object alone to stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from cluster.bench.sizing import WORKLOAD_NAMES

CONFIGS = ("colocated", "disagg", "auto")
# config -> (app, x-pd-mode)
ROUTES = {"colocated": ("colocated", "local"), "disagg": ("pd", "disagg"), "auto": ("pd", "auto")}
TARGETS = {"disagg_itl_p99_vs_colocated": ("<=", 0.5), "auto_ttft_p50_vs_colocated_short_low_load": ("<=", 1.05),
           "auto_goodput_vs_best_short_low_load": (">=", 0.95), "auto_goodput_vs_best_long_high_load": (">=", 0.95),
           "auto_goodput_vs_best_mixed": (">=", 0.95), "router_overhead_ttft_p50_ms": ("<=", 5.0)}


@dataclass
class BenchOptions:
    preset: str = "small"
    model_cache: str | None = None
    repeats: int = 3
    request_factor: float = 1.0
    prompt_factor: float = 1.0
    rate_factor: float = 1.0
    num_requests: int | None = None  # each workload scaled to about this many requests
    overhead_samples: int = 60  # 0: no router-overhead measurement
    workloads: tuple[str, ...] | None = None  # a subset of the workload names; None: all
    direct_ingress: bool = True  # Serve's direct ingress on (the proxy still runs)
    out: Path = Path("runs/bench-cluster")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("cluster")(bench_cluster_cmd)


def bench_cluster_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    repeats: int = typer.Option(3, min=1, help="Interleaved repeats of every (workload, configuration)."),
    num_requests: int | None = typer.Option(None, min=2, help="Scale each workload to about this many requests."),
    quick: bool = typer.Option(False, "--quick", help="Smoke-test size: tiny model, 1 repeat, short workloads."),
    preset: str = typer.Option("small", help="Embedded model preset (tiny, small)."),
    model_cache: str | None = typer.Option(None, help="Where the preset is made once (default ~/.cache/pdcluster)."),
    overhead_samples: int = typer.Option(60, min=0, help="Requests per path for the router-overhead figure "
                                                         "(0: skip it)."),
    workloads: str | None = typer.Option(None, "--workloads", help="Comma-separated subset of the workloads "
                                         f"({', '.join(WORKLOAD_NAMES)}); default all."),
    out: Path = typer.Option(Path("runs/bench-cluster"), "--out", help="Folder for every run's report."),
    direct_ingress: bool = typer.Option(True, help="Turn on Serve's direct ingress (router replicas answer "
                                        "HTTP themselves) and time the router overhead there as well as "
                                        "through the proxy."),
) -> None:
    """Colocated vs disaggregated vs auto on equal cores, three workloads, with ratios."""
    from rich.console import Console

    opts = BenchOptions(preset, model_cache, repeats, overhead_samples=overhead_samples, out=out,
                        direct_ingress=direct_ingress)
    if quick:  # the tiny model runs these ~10x faster than small: shorter and denser
        opts.preset, opts.repeats, opts.overhead_samples = "tiny", 1, min(overhead_samples, 6)
        opts.request_factor, opts.prompt_factor = 0.25, 0.5
    opts.num_requests = num_requests
    console = Console(stderr=True, log_path=False)
    try:
        opts.workloads = parse_workloads(workloads)
        with stdout_to_stderr():  # Ray prints its processes' log lines on stdout
            result = run_bench(opts, console.log)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]bench cluster failed:[/] {e}")
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print(result, Console())


@contextlib.contextmanager
def stdout_to_stderr():
    """Point file descriptor 1 (and `sys.stdout`) at stderr for the duration, so that
    only the JSON object reaches stdout whatever Ray or its C++ core prints."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def parse_workloads(text: str | None) -> tuple[str, ...] | None:
    """`--workloads a,b`: the named workloads in the benchmark's own order; None for all."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOAD_NAMES]
    if unknown or not names:
        raise ValueError(f"--workloads: unknown {', '.join(unknown) or '(empty)'}; "
                         f"choose from {', '.join(WORKLOAD_NAMES)}")
    return tuple(n for n in WORKLOAD_NAMES if n in names)


def run_bench(opts: BenchOptions, log) -> dict:
    import ray.serve  # noqa: F401 - this process reads Serve's settings before serve_env changes them

    from cluster.bench.router_overhead import measure
    from cluster.bench.sizing import bench_workloads, measure_baseline
    from cluster.local.apps import app_args, ensure_preset, expected_pools
    from cluster.local.ray_cluster import LocalCluster
    from cluster.local.runs import warm_up

    started, load_start = time.perf_counter(), os.getloadavg()
    serve_env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"} if opts.direct_ingress else {}
    with LocalCluster(log=log, serve_env=serve_env) as cluster:
        ensure_preset(opts.preset, opts.model_cache, log)
        log("deploying colocated (2 decode replicas) and pd (1 prefill + 1 decode)")
        colocated, pd = cluster.deploy_many([
            ("colocated", app_args(opts.preset, opts.model_cache, 0, 2, "local"), "/colocated", expected_pools(0, 2)),
            ("pd", app_args(opts.preset, opts.model_cache, 1, 1, "auto"), "/pd", expected_pools(1, 1)),
        ])
        urls = {"colocated": colocated, "pd": pd}
        log("warming up (first transfers, first shapes)")
        warm_up(colocated, ("local",))
        warm_up(pd, ("local", "disagg"))
        baseline = measure_baseline(colocated)
        log(f"baseline (one request alone on one replica): {baseline}")
        workloads = {k: _sized(w, opts) for k, w in bench_workloads(baseline).items()
                     if opts.workloads is None or k in opts.workloads}
        for w in workloads.values():
            for line in w.describe():
                log(line)
        runs = _run_all(opts, workloads, urls, log)
        proxied = direct = None
        if opts.overhead_samples > 0:
            log("router overhead: HTTP through the router vs the decode replica called directly "
                "(a Serve handle, and its worker stream)")
            proxied = measure(urls["pd"], "pd", num_samples=opts.overhead_samples)
            direct_url = cluster.direct_url("pd", "/pd") if opts.direct_ingress else None
            if direct_url:
                log(f"router overhead again, straight to the router replica (direct ingress, {direct_url})")
                direct = {**measure(direct_url, "pd", num_samples=opts.overhead_samples), "url": direct_url}
    overhead = direct or proxied  # the figure the target is read from
    results = {name: {config: _medians(rs) for config, rs in by_config.items()} for name, by_config in runs.items()}
    ratios = _ratios(results, overhead)
    if direct is not None:
        ratios["router_overhead_via_proxy_ttft_p50_ms"] = proxied["router_overhead_ttft_p50_ms"]
    return {
        "bench": "cluster",
        "results": results,
        "ratios": ratios,
        "targets": {k: {"target": f"{op} {v:g}", "value": ratios.get(k), "met": _met(ratios.get(k), op, v)}
                    for k, (op, v) in TARGETS.items() if k in ratios},
        "router_overhead": overhead,
        "router_overhead_via_proxy": proxied,
        "setup": _setup(opts, workloads, baseline),
        "machine": {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "run_time_s": round(time.perf_counter() - started, 1),
    }


def _sized(workload, opts: BenchOptions):
    factor = opts.num_requests / workload.num_requests if opts.num_requests else opts.request_factor
    return workload.scaled(factor, opts.prompt_factor, opts.rate_factor)


def _run_all(opts: BenchOptions, workloads: dict, urls: dict, log) -> dict[str, dict[str, list[dict]]]:
    """Every (repeat, workload, configuration), configurations rotated each repeat."""
    from cluster.bench.cpu_probe import CpuProbe
    from cluster.local.runs import run_workload

    probe = CpuProbe.for_serve()
    runs: dict[str, dict[str, list[dict]]] = {name: {c: [] for c in CONFIGS} for name in workloads}
    total, done = opts.repeats * len(workloads) * len(CONFIGS), 0
    for repeat in range(opts.repeats):
        order = CONFIGS[repeat % len(CONFIGS):] + CONFIGS[:repeat % len(CONFIGS)]
        for w_index, (name, workload) in enumerate(workloads.items()):
            for c_index, config in enumerate(order):
                app, mode = ROUTES[config]
                seed = 10_000 * (repeat + 1) + 100 * w_index + c_index
                before = probe.sample()
                run = run_workload(urls[app], workload, mode, opts.out / f"r{repeat}" / name / config, seed)
                figures = dict(run.figures(), cpu_s=probe.used(before))
                runs[name][config].append(figures)
                done += 1
                log(f"[{done}/{total}] repeat {repeat} {name:15s} {config:9s} TTFT p50 {figures['ttft_p50_ms']:8.1f} "
                    f"ITL p99 {figures['itl_p99_ms']:8.1f} goodput {figures['goodput_rps']:.3f}/s "
                    f"failed {figures['failed']} routes {figures['routes']}")
                time.sleep(1.0)  # heartbeats catch up: the next run starts from an idle view
    return runs


def _medians(repeats: list[dict]) -> dict:
    keys = [k for k, v in repeats[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: _median([r.get(k) for r in repeats]) for k in keys}
    out["routes"] = _sum_dicts(r["routes"] for r in repeats)
    out["cpu_s"] = {k: _median([r["cpu_s"].get(k) for r in repeats]) for k in repeats[0]["cpu_s"]}
    out["repeats"] = [{k: v for k, v in r.items() if k != "cpu_s"} for r in repeats]
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _sum_dicts(dicts) -> dict:
    total: dict = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _ratios(results: dict, overhead: dict | None) -> dict:
    """Every ratio whose workloads ran (`--workloads` may leave some out)."""
    ratios: dict = {}
    if "mixed" in results:
        mixed = results["mixed"]
        ratios.update({
            "disagg_itl_p99_vs_colocated": _ratio(mixed["disagg"]["itl_p99_ms"], mixed["colocated"]["itl_p99_ms"]),
            "disagg_short_itl_p99_vs_colocated": _ratio(mixed["disagg"].get("short_itl_p99_ms"),
                                                        mixed["colocated"].get("short_itl_p99_ms")),
            "auto_itl_p99_vs_colocated_mixed": _ratio(mixed["auto"]["itl_p99_ms"],
                                                      mixed["colocated"]["itl_p99_ms"]),
        })
    if "short_low_load" in results:
        short = results["short_low_load"]
        ratios["auto_ttft_p50_vs_colocated_short_low_load"] = _ratio(short["auto"]["ttft_p50_ms"],
                                                                     short["colocated"]["ttft_p50_ms"])
    for name, by_config in results.items():
        best = max((by_config[c]["goodput_rps"] or 0.0) for c in ("colocated", "disagg"))
        ratios[f"auto_goodput_vs_best_{name}"] = _ratio(by_config["auto"]["goodput_rps"], best)
    if overhead is not None:
        ratios["router_overhead_ttft_p50_ms"] = overhead["router_overhead_ttft_p50_ms"]
        if "router_overhead_vs_stream_p50_ms" in overhead:  # against the replica's worker stream
            ratios["router_overhead_vs_stream_p50_ms"] = overhead["router_overhead_vs_stream_p50_ms"]
    return ratios


def _met(value: float | None, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target


def _setup(opts: BenchOptions, workloads: dict, baseline) -> dict:
    from cluster.bench.sizing import describe
    from cluster.local.apps import MAX_NUM_BATCHED_TOKENS

    return {
        "preset": opts.preset, "repeats": opts.repeats, "torch_threads_per_replica": 1,
        "workloads_run": list(workloads), "overhead_samples": opts.overhead_samples,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "configs": {"colocated": "2 decode replicas, every request local",
                    "disagg": "1 prefill + 1 decode, x-pd-mode: disagg (every request remote)",
                    "auto": "1 prefill + 1 decode, x-pd-mode: auto (router decides)"},
        "baseline": describe(baseline),
        "workloads": {name: w.describe() for name, w in workloads.items()},
        "order": "per repeat: every workload, configurations rotated; medians over repeats",
        "out": str(opts.out),
    }


def _print(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title="bench cluster (medians over repeats)")
    for column in ("workload", "config", "TTFT p50", "ITL p99", "goodput/s", "goodput %", "routes"):
        table.add_column(column)
    for name, by_config in result["results"].items():
        for config, r in by_config.items():
            table.add_row(name, config, f"{r['ttft_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                          f"{r['goodput_rps']:.3f}", f"{100 * (r['goodput_fraction'] or 0):.0f}", str(r["routes"]))
    console.print(table)
    for key, target in result["targets"].items():
        console.print(f"{key}: {target['value']} (target {target['target']}: {'met' if target['met'] else 'MISSED'})")
