"""`pdcluster bench engine`: progress on stderr, the JSON report alone on stdout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from cluster.bench.engine import DEFAULT_MODEL_CACHE, BenchConfig


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("engine")(bench_engine_cmd)


def bench_engine_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    preset: str = typer.Option("small", help="Model preset (tiny, small)."),
    num_requests: int = typer.Option(48, min=1, help="Number of requests."),
    seed: int = typer.Option(0, help="Workload seed (prompt tokens and lengths)."),
    max_prompt_len: int = typer.Option(512, min=32, help="Prompt lengths are uniform in 32..this."),
    max_output_len: int = typer.Option(128, min=16, help="Output lengths are uniform in 16..this."),
    batch_sizes: str = typer.Option("8,16,32", help="transformers generate batch sizes; the best counts."),
    threads: int = typer.Option(os.cpu_count() or 1, min=1, help="torch threads (default: all cores)."),
    model_cache: Path = typer.Option(DEFAULT_MODEL_CACHE, help="Where the benchmark model is made once."),
    decode_batches: str = typer.Option("1,8,32", help="Decode batches measured against the read floor."),
    decode_contexts: str = typer.Option("512,2048", help="Decode contexts measured against the read floor."),
    profile: bool = typer.Option(False, "--profile", help="Only split steps into phases (decode batches, "
                                 "one context; a prefill step) and print that."),
    profile_context: int = typer.Option(512, min=2, help="With --profile: the decode steps' context."),
) -> None:
    """This engine vs transformers generate (static batches) and continuous batching, and
    vs the machine's limits (bare matmuls, memory reads); or, with --profile, where a step's time goes."""
    import torch
    from rich.console import Console

    from cluster.bench.engine import run_benchmark, run_profile_report

    torch.set_num_threads(threads)
    cfg = BenchConfig(preset=preset, num_requests=num_requests, seed=seed,
                      prompt_len_range=(32, max_prompt_len), output_len_range=(16, max_output_len),
                      hf_batch_sizes=_parse_sizes(batch_sizes, "--batch-sizes"), model_cache=model_cache,
                      decode_batches=_parse_sizes(decode_batches, "--decode-batches"),
                      decode_contexts=_parse_sizes(decode_contexts, "--decode-contexts"))
    console = Console(stderr=True, log_path=False)
    with console.status("benchmarking ..."):
        log = lambda msg: console.log(msg)  # noqa: E731
        result = run_profile_report(cfg, profile_context, log) if profile else run_benchmark(cfg, log=log)
    if as_json:
        typer.echo(json.dumps(result))
    elif profile:
        _print_profile(result)
    else:
        _print_table(result)


def _parse_sizes(text: str, option: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter("a comma-separated list of positive integers", param_hint=option)
    return sizes


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="bench engine (generated tokens only)")
    for column in ("runner", "tokens/s", "wall s"):
        table.add_column(column)
    for r in result["results"]:
        table.add_row(r["name"], f"{r['tokens_per_s']:.1f}", f"{r['wall_s']:.2f}")
    console = Console()
    console.print(table)
    m = result["mismatches"]
    console.print(f"ratios: {result['ratios']}; identical tokens: {result['identical_tokens']} "
                  f"(mismatches: {m['near_tie']} near ties, {m['real']} real)")


def _print_profile(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from cluster.bench.engine_profile import PHASES

    table = Table(title=f"bench engine --profile ({result['workload']['preset']}): mean ms (share of the step)")
    for column in ("step", "step ms", *PHASES, "outside forward"):
        table.add_column(column)
    for name, split in result["profile"].items():
        cells = [f"{p['mean_s'] * 1e3:.2f} ({p['share']:.1%})" for p in split["phases"].values()]
        table.add_row(name, f"{split['step_s'] * 1e3:.1f}", *cells, f"{split['outside_forward']:.1%}")
    Console().print(table)
