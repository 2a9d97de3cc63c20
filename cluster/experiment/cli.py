"""`pdcluster experiment FILE.yaml [--url URL] [--out DIR] [--dry-run]` and
`pdcluster experiment --rollback DIR`."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def experiment_cmd(
    file: Path | None = typer.Argument(None, help="The experiment file (YAML; see docs/experiment.md)."),
    url: str | None = typer.Option(None, help="The deployment's base URL (wins over the file's `url`)."),
    out: Path | None = typer.Option(None, help="Output folder (default runs/experiment-<name>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (runs, changes) and change nothing."),
    rollback: Path | None = typer.Option(None, help="Restore the profiles an earlier, killed experiment "
                                         "changed, from the journal in this output folder."),
) -> None:
    """Baseline first, one change at a time: run variants against a live deployment, compare
    them with stated noise rules, check output quality, and roll every change back.

    Profile changes go through the admin API with PDC_ADMIN_TOKEN."""
    token = os.environ.get("PDC_ADMIN_TOKEN") or None
    if rollback is not None:
        raise typer.Exit(_rollback(rollback, url, token))
    if file is None:
        typer.echo("experiment: give an experiment FILE (or --rollback DIR)", err=True)
        raise typer.Exit(2)
    from cluster.experiment.spec import load_spec

    try:
        spec = load_spec(file)
    except (ValueError, OSError) as e:
        typer.echo(f"experiment: {e}", err=True)
        raise typer.Exit(2) from None
    target = (url or spec.url or "").rstrip("/")
    if not target:
        typer.echo("experiment: no URL: give --url or `url:` in the file", err=True)
        raise typer.Exit(2)
    if dry_run:
        raise typer.Exit(_dry_run(spec, target, token))
    raise typer.Exit(_run(spec, target, out or Path("runs") / f"experiment-{spec.name}", token))


def _dry_run(spec, url: str, token: str | None) -> int:
    from cluster.experiment.admin import AdminClient, AdminError
    from cluster.experiment.runner import describe_plan

    snapshot = None
    try:
        admin = AdminClient(url, token)
        snapshot = admin.get()[1]
        admin.close()
    except AdminError as e:
        typer.echo(f"(profiles not read: {e})")
    typer.echo("dry run: nothing is changed\n" + "\n".join(describe_plan(spec, snapshot)))
    return 0


def _run(spec, url: str, out: Path, token: str | None) -> int:
    from rich.progress import Progress

    from cluster.experiment.admin import AdminError
    from cluster.experiment.analysis import analyse
    from cluster.experiment.report import write_report
    from cluster.experiment.runner import run_experiment, run_order

    total = len(run_order(spec))
    with Progress(transient=False) as progress:
        task = progress.add_task(f"{spec.name}: {total} runs", total=total)

        def on_run(result, _total) -> None:
            progress.update(task, advance=1, description=f"{result.key.workload}/{result.key.variant} "
                            f"r{result.key.repeat} done")

        try:
            exp = run_experiment(spec, url, out, token, on_run)
        except AdminError as e:
            typer.echo(f"experiment: {e}", err=True)
            return 2
    report = write_report(exp, analyse(exp), plots=spec.plots)
    for workload, found in report["workloads"].items():
        typer.echo(f"{workload}: {found['recommendation']['decision']} - {found['recommendation']['evidence']}")
    typer.echo(f"wrote {out}/report.md")
    if exp.stopped:
        typer.echo(f"experiment stopped early: {exp.stopped}", err=True)
        return 1
    return 0


def _rollback(out: Path, url: str | None, token: str | None) -> int:
    from cluster.experiment.admin import AdminClient, AdminError
    from cluster.experiment.journal import Journal, read_journal
    from cluster.experiment.rollback import rollback_dir

    try:
        start = next((r for r in read_journal(out) if r["event"] == "start"), {})
        admin = AdminClient(url or start.get("url", ""), token)
        rows = rollback_dir(admin, Journal(out))
    except (AdminError, ValueError) as e:
        typer.echo(f"experiment --rollback: {e}", err=True)
        return 2
    for row in rows:
        typer.echo(f"{row['workload']}: {row['event']} {row.get('action') or row.get('reason', '')}")
    return 0


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("experiment")(experiment_cmd)
