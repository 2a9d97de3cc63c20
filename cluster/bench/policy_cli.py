"""`pdcluster bench policy`: progress on stderr, the JSON report alone on stdout with `--json`."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("policy")(bench_policy_cmd)


def bench_policy_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    replicas: int = typer.Option(64, "--replicas", min=2, help="Replicas in the router's view."),
    prefill_replicas: int | None = typer.Option(None, "--prefill-replicas", min=1,
                                                help="How many of them are prefill replicas (default: half)."),
    decisions: int = typer.Option(5000, "--decisions", min=1, help="Timed decisions per mode."),
    warmup: int = typer.Option(500, "--warmup", min=0, help="Untimed decisions per mode before them."),
    seed: int = typer.Option(0, "--seed", help="Requests, heartbeats and outcomes seed."),
    gc_gen0_threshold: int | None = typer.Option(
        None, "--gc-gen0-threshold", min=0,
        help="The router's young-generation GC threshold to measure under (default: the router's, "
             "router.gc_gen0_threshold; 0: Python's own collector settings)."),
) -> None:
    """Latency of one routing decision (`place()`) in modes auto and threshold (target: auto p99 < 1 ms)."""
    from rich.console import Console

    from cluster.bench.policy import PolicyBenchConfig, run_benchmark

    if prefill_replicas is not None and prefill_replicas >= replicas:
        raise typer.BadParameter("must leave at least one decode replica", param_hint="--prefill-replicas")
    cfg = PolicyBenchConfig(num_replicas=replicas, num_prefill=prefill_replicas, num_decisions=decisions,
                            num_warmup=warmup, seed=seed, **_gc_setting(gc_gen0_threshold))
    console = Console(stderr=True, log_path=False)
    result = run_benchmark(cfg, log=lambda msg: console.log(msg))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_table(result)


def _gc_setting(threshold: int | None) -> dict:
    """The config field for `--gc-gen0-threshold`: nothing (the router's default), or
    None for 0 (Python's collector as it comes)."""
    if threshold is None:
        return {}
    return {"gc_gen0_threshold": threshold or None}


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    setup = result["setup"]
    table = Table(title=f"bench policy: one place() call, {setup['num_prefill']} prefill + "
                        f"{setup['num_decode']} decode replicas, {setup['num_decisions']} decisions")
    for column in ("mode", "p50 ms", "p99 ms", "max ms", "CPU p50 ms", "CPU p99 ms", "decisions/s",
                   "machine p99/p50"):
        table.add_column(column)
    for mode, r in result["results"].items():
        table.add_row(mode, f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['max_ms']:.3f}", f"{r['cpu_p50_ms']:.3f}",
                      f"{r['cpu_p99_ms']:.3f}", f"{r['decisions_per_s']:,.0f}", f"{r['machine_probe_p99_over_p50']:.2f}")
    console = Console()
    console.print(table)
    for mode, r in result["results"].items():
        console.print(f"{mode}: routes {_mix(r['routes'])}; kinds {_mix(r['kinds'])}; "
                      f"prefix hits {r['prefix_hit_fraction']:.0%}")
    for key, target in result["targets"].items():
        console.print(f"{key}: {target['value']} (limit < {target['limit']}: {'met' if target['met'] else 'MISSED'})")
    console.print("machine p99/p50: the same fixed work timed after each decision, its p99 over its median "
                  "(near 1 on a quiet, dedicated core)")
    console.print(f"garbage collector thresholds {tuple(setup['gc_thresholds'])}")
    console.print(f"load average {result['machine']['loadavg_start']} -> {result['machine']['loadavg_end']} "
                  f"on {result['machine']['cores']} cores")


def _mix(counts: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
