"""`pdcluster doctor --url URL [--run DIR] [--json]`: the symptoms a deployment shows, each
with its numbers and what fits. Exits 0 whenever it ran (findings or not; a run folder it
cannot read becomes a note) and 2 only when the deployment cannot be reached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer


def doctor_cmd(
    url: str = typer.Option(..., help="The deployment's base URL, e.g. http://127.0.0.1:8000."),
    run: Path | None = typer.Option(None, help="A `pdcluster loadtest` output folder: its requests (routes, "
                                    "prompt lengths and block hashes) and, when saved with --save-metrics, "
                                    "the server's metrics over exactly that run."),
    window: float = typer.Option(10.0, min=1.0, help="Seconds of live /metrics to watch when no run "
                                 "folder holds its own."),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis as JSON."),
) -> None:
    """Diagnose a live deployment: name its bottleneck and the technique or setting that fits.

    Reads /metrics, /health and (with PDC_ADMIN_TOKEN set) the admin view of profiles and
    engines; with --run, also a load test's records."""
    from cluster.doctor.collect import Unreachable, collect
    from cluster.doctor.report import as_json as to_json
    from cluster.doctor.report import print_findings
    from cluster.doctor.symptoms import diagnose

    try:
        evidence = collect(url, run, window, os.environ.get("PDC_ADMIN_TOKEN") or None)
    except Unreachable as e:
        typer.echo(f"doctor: {e}", err=True)
        raise typer.Exit(2) from None
    findings = diagnose(evidence)
    if as_json:
        typer.echo(json.dumps(to_json(findings, evidence), indent=2))
    else:
        print_findings(findings, evidence)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)
