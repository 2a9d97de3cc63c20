"""`pdcluster bench api`: progress on stderr, the JSON report alone on stdout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from cluster.bench.engine import DEFAULT_MODEL_CACHE


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("api")(bench_api_cmd)


def bench_api_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    preset: str = typer.Option("small", help="Model preset (tiny, small)."),
    num_requests: int = typer.Option(16, min=1, help="Number of requests per run."),
    repeats: int = typer.Option(7, min=1, help="Rounds of every configuration; the median of each round's own ratio counts."),
    seed: int = typer.Option(0, help="Workload and sampling seed."),
    max_prompt_len: int = typer.Option(256, min=32, help="Prompt lengths are uniform in 32..this."),
    max_output_len: int = typer.Option(64, min=16, help="Output lengths are uniform in 16..this."),
    threads: int = typer.Option(os.cpu_count() or 1, min=1, help="torch threads (default: all cores)."),
    model_cache: Path = typer.Option(DEFAULT_MODEL_CACHE, help="Where the benchmark model is made once."),
) -> None:
    """Engine tokens/s with logprobs, penalties, n=4 and a JSON schema, against plain sampling."""
    import torch
    from rich.console import Console

    from cluster.bench.api import ApiBenchConfig, run_benchmark

    torch.set_num_threads(threads)
    cfg = ApiBenchConfig(preset=preset, num_requests=num_requests, repeats=repeats, seed=seed,
                         prompt_len_range=(32, max_prompt_len), output_len_range=(16, max_output_len),
                         model_cache=model_cache)
    console = Console(stderr=True, log_path=False)
    with console.status("benchmarking ..."):
        result = run_benchmark(cfg, log=lambda msg: console.log(msg))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        _print_table(result)


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench api (engine, generated tokens, medians)")
    for column in ("configuration", "tokens/s", "wall s", "tokens", "prompt tokens computed"):
        table.add_column(column)
    for name, r in result["results"].items():
        table.add_row(name, f"{r['tokens_per_s']:.1f}", f"{r['wall_s']:.2f}", str(r["num_generated_tokens"]),
                      str(r["num_prompt_tokens_computed"]))
    console = Console()
    console.print(table)
    for key, target in result["targets"].items():
        console.print(f"{key}: {target['value']} (limit {target['limit']}: {'met' if target['met'] else 'MISSED'})")
