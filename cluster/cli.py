"""The `pdcluster` command line. Each command's work lives in its own module and is
imported only when that command runs, so `pdcluster --help` stays fast."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="pdcluster: disaggregated prefill/decode LLM serving on Ray Serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that run pdcluster and its peers in one process.")
app.add_typer(bench_app, name="bench")


@app.command("make-model")
def make_model_cmd(
    out_dir: Path = typer.Argument(..., help="Folder to write the model into."),
    preset: str = typer.Option("tiny", help="tiny (fast tests) or small (~23M params, GQA)."),
    seed: int = typer.Option(0, help="Weight seed: same seed, same bytes."),
) -> None:
    """Write a HuggingFace model folder with random weights and a byte-level tokenizer."""
    from workers.model_files import PRESETS, make_model

    if preset not in PRESETS:
        raise typer.BadParameter(f"choose one of {', '.join(sorted(PRESETS))}", param_hint="--preset")
    path = make_model(out_dir, preset, seed)
    typer.echo(f"wrote {preset} model (seed {seed}) to {path}")


# Modules that each define `register(app, bench_app)` for their own commands.
COMMAND_MODULES: tuple[str, ...] = (
    "cluster.serve_cli", "cluster.loadtest.cli", "cluster.local.demo", "cluster.bench.engine_cli",
    "cluster.bench.transport_cli", "cluster.bench.cluster", "cluster.bench.router_overhead_cli",
    "cluster.bench.api_cli", "cluster.bench.policy_cli", "cluster.bench.plan", "cluster.plan.cli",
    "cluster.doctor.cli", "cluster.experiment.cli",
)


def _register_commands() -> None:
    import importlib

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(app, bench_app)


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
