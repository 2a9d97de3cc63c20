"""`pdcluster bench cluster --json`: colocated vs disaggregated vs the router's policies
on equal cores.

Two apps are deployed side by side on one local Ray, each with two single-threaded
engine replicas and the same engine settings:

- `colocated` (`/colocated`): 2 decode replicas, profile `local`: every request is
  prefilled and decoded on one replica, the router balancing by load.
- `pd` (`/pd`): 1 prefill + 1 decode replica; `x-pd-mode: disagg` prefills every request
  remotely, `threshold` by the token-threshold rule, `auto` as the predictive policy
  decides against each class's SLO (the `bench_short` / `bench_long` profiles, set
  through the admin API before each `auto` run).

Three workloads (`cluster.bench.sizing`: rates and SLOs sized to this machine) run in
every configuration (`auto` once per SLO cell, `cluster.bench.slo_cells`), repeated,
interleaved (configuration order rotated each repeat), each run with fresh prompt
bytes; figures are medians over repeats, good requests are pooled. When `mixed` runs,
so do the two scenarios (`cluster.bench.cluster_scenarios`: disaggregation hurts, the
load shifts). With Serve's direct ingress on (the default), the baseline, the workloads
and the scenarios go straight to each app's router replica, as an L4 balancer in front
of the replicas would send them (`--via-proxy`: through Serve's Python proxy, which on
two cores queues requests for up to a few hundred ms alike for every configuration).
Then the router's own TTFT cost is measured against calling the decode deployment
through a Serve handle, through the proxy and straight. `--workloads` re-runs a subset (ratios only for what
ran); `--overhead-samples 0` skips the router-overhead part.
Progress goes to stderr, the JSON object alone to stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

from cluster.bench.sizing import WORKLOAD_NAMES

DEFAULT_REPEATS = 2  # 8 configurations x 3 workloads x 2 + the scenarios: ~30 minutes on 2 cores


@dataclass
class BenchOptions:
    preset: str = "small"
    model_cache: str | None = None
    repeats: int = DEFAULT_REPEATS
    request_factor: float = 1.0
    prompt_factor: float = 1.0
    rate_factor: float = 1.0
    num_requests: int | None = None  # each workload scaled to about this many requests
    overhead_samples: int = 60  # 0: no router-overhead measurement
    workloads: tuple[str, ...] | None = None  # a subset of the workload names; None: all
    direct_ingress: bool = True  # Serve's direct ingress on (the proxy still runs)
    via_proxy: bool = False  # workloads through Serve's proxy even with direct ingress on
    out: Path = Path("runs/bench-cluster")
    scenario_span_s: float = 90.0  # disagg_hurts: the run, half before the fault and half after
    scenario_num_long: int = 30  # disagg_hurts: long prompts over the span
    shift_half_s: float = 15.0  # load_shift: each half
    save_steps: bool = False  # every run folder also gets the apps' steps.jsonl / transfers.jsonl


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("cluster")(bench_cluster_cmd)


def bench_cluster_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    repeats: int = typer.Option(DEFAULT_REPEATS, min=1, help="Interleaved repeats of every (workload, "
                                "configuration); the scenarios run once."),
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
    save_steps: bool = typer.Option(False, "--save-steps", help="Beside each run's requests.jsonl, write the "
                                    "app's step and KV transfer records over the run (steps.jsonl, "
                                    "transfers.jsonl) for `pdcluster plan calibrate --run`, and report how "
                                    "fast the machine ran each run (machine_speed)."),
    via_proxy: bool = typer.Option(False, "--via-proxy", help="Send the baseline, the workloads and the "
                                   "scenarios through Serve's proxy even with direct ingress on (by default "
                                   "they go straight to each app's router replica, as an L4 balancer would "
                                   "send them; the proxy's own queueing on a small machine is the same for "
                                   "every configuration and hides their differences)."),
) -> None:
    """Colocated vs disaggregated vs threshold vs auto on equal cores: three workloads in
    five SLO cells, two scenarios, with ratios and targets."""
    from rich.console import Console

    opts = BenchOptions(preset, model_cache, repeats, overhead_samples=overhead_samples, out=out,
                        direct_ingress=direct_ingress, via_proxy=via_proxy)
    if quick:  # the tiny model runs these ~10x faster than small: shorter and denser
        opts.preset, opts.repeats, opts.overhead_samples = "tiny", 1, min(overhead_samples, 6)
        opts.request_factor, opts.prompt_factor = 0.25, 0.5
        opts.scenario_span_s, opts.scenario_num_long, opts.shift_half_s = 7.0, 6, 3.0
    opts.num_requests = num_requests
    opts.save_steps = save_steps
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
        from cluster.bench.cluster_report import print_report

        print_report(result, Console())


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

    from cluster.bench.cluster_report import build_report
    from cluster.bench.cluster_runs import Bench, run_folders, run_scenarios, run_workloads
    from cluster.bench.machine_speed import from_folders
    from cluster.bench.policy_admin import PolicyAdmin, admin_token_file
    from cluster.bench.router_overhead import measure
    from cluster.bench.sizing import bench_workloads, measure_baseline
    from cluster.local.apps import app_args, ensure_preset, expected_pools
    from cluster.local.ray_cluster import LocalCluster, direct_ingress_env
    from cluster.local.runs import warm_up
    from workers.model_files import PRESETS

    started, load_start = time.perf_counter(), os.getloadavg()
    serve_env = direct_ingress_env() if opts.direct_ingress else {}
    with admin_token_file() as (token_file, token), LocalCluster(log=log, serve_env=serve_env) as cluster:
        ensure_preset(opts.preset, opts.model_cache, log)
        log("deploying colocated (2 decode replicas) and pd (1 prefill + 1 decode, test-only fault injection "
            "on, no fault set), both with the admin API on")
        proxied_urls = cluster.deploy_many([
            ("colocated", app_args(opts.preset, opts.model_cache, 0, 2, "local", admin_token_file=token_file),
             "/colocated", expected_pools(0, 2)),
            ("pd", app_args(opts.preset, opts.model_cache, 1, 1, "auto", admin_token_file=token_file, faults=True),
             "/pd", expected_pools(1, 1)),
        ])
        colocated, pd = urls = _workload_urls(cluster, opts, dict(zip(("colocated", "pd"), proxied_urls, strict=True)),
                                              log)
        proxied_any = any(u == p for u, p in zip(urls, proxied_urls, strict=True))
        workload_path = "proxy" if proxied_any else "direct ingress"
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
        bench = Bench({"colocated": colocated, "pd": pd},
                      {"colocated": PolicyAdmin(colocated, token), "pd": PolicyAdmin(pd, token)}, baseline, opts.out, log,
                      save_steps_token=token if opts.save_steps else None)
        runs = run_workloads(bench, workloads, opts.repeats)
        scenarios = {}
        if "mixed" in workloads:
            scenarios = run_scenarios(bench, opts.prompt_factor, opts.scenario_span_s, opts.scenario_num_long,
                                      opts.shift_half_s, PRESETS[opts.preset].num_hidden_layers)
        proxied = direct = None
        if opts.overhead_samples > 0:
            log("router overhead: HTTP through the router vs the decode replica called directly "
                "(a Serve handle, and its worker stream)")
            proxied = measure(proxied_urls[1], "pd", num_samples=opts.overhead_samples)
            direct_url = cluster.direct_url("pd", "/pd") if opts.direct_ingress else None
            if direct_url:
                log(f"router overhead again, straight to the router replica (direct ingress, {direct_url})")
                direct = {**measure(direct_url, "pd", num_samples=opts.overhead_samples), "url": direct_url}
    overhead = direct or proxied  # the figure the target is read from
    report = build_report(baseline, workloads, runs, scenarios, overhead)
    # the steps' CPU time per unit of work, run by run (only with the records saved)
    report["machine_speed"] = from_folders(run_folders(opts.out, workloads, opts.repeats)) if opts.save_steps else {}
    if direct is not None:
        report["ratios"]["router_overhead_via_proxy_ttft_p50_ms"] = proxied["router_overhead_ttft_p50_ms"]
    return {
        "bench": "cluster",
        **report,
        "router_overhead": overhead,
        "router_overhead_via_proxy": proxied,
        "setup": _setup(opts, workloads, baseline, workload_path),
        "machine": {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "run_time_s": round(time.perf_counter() - started, 1),
    }


def _workload_urls(cluster, opts: BenchOptions, proxied: dict[str, str], log) -> list[str]:
    """Each app's URL for the baseline, the workloads and the scenarios: its router
    replica's own address under direct ingress (unless `via_proxy`), else the proxy's."""
    if not opts.direct_ingress or opts.via_proxy:
        log("workloads go through Serve's proxy")
        return list(proxied.values())
    urls = [cluster.direct_url(app, "/" + app) or url for app, url in proxied.items()]
    log(f"workloads go straight to the router replicas (direct ingress): {', '.join(urls)}")
    return urls


def _sized(workload, opts: BenchOptions):
    factor = opts.num_requests / workload.num_requests if opts.num_requests else opts.request_factor
    return workload.scaled(factor, opts.prompt_factor, opts.rate_factor)


def _setup(opts: BenchOptions, workloads: dict, baseline, workload_path: str) -> dict:
    from cluster.bench.cluster_report import cells_setup
    from cluster.bench.sizing import describe
    from cluster.local.apps import MAX_NUM_BATCHED_TOKENS

    return {
        "preset": opts.preset, "repeats": opts.repeats, "torch_threads_per_replica": 1,
        "workloads_run": list(workloads), "overhead_samples": opts.overhead_samples,
        "workload_path": workload_path,  # "direct ingress" only where every app's runs went straight there
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "configs": {"colocated": "2 decode replicas, every request local",
                    "disagg": "1 prefill + 1 decode, x-pd-mode: disagg (every request remote)",
                    "threshold": "1 prefill + 1 decode, x-pd-mode: threshold (the token-threshold rule)",
                    "auto": "1 prefill + 1 decode, x-pd-mode: auto, class profiles with the balanced SLOs",
                    "auto_<cell>": "as auto, the class profiles carrying that cell's SLOs"},
        "cells": cells_setup(),
        "scenarios": {"run": "mixed" in workloads, "span_s": opts.scenario_span_s,
                      "num_long": opts.scenario_num_long, "shift_half_s": opts.shift_half_s},
        "baseline": describe(baseline),
        "workloads": {name: w.describe() for name, w in workloads.items()},
        "order": "per repeat: every workload, configurations rotated; then each scenario once per configuration, "
                 "load_shift before disagg_hurts",
        "out": str(opts.out),
    }
