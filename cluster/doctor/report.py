"""The diagnosis as a table for people and as JSON for scripts."""

from __future__ import annotations

from typing import Any

from cluster.doctor.evidence import Evidence
from cluster.doctor.symptoms import Finding


def as_json(findings: list[Finding], ev: Evidence) -> dict[str, Any]:
    return {"source": ev.source, "status": (ev.health or {}).get("status"),
            "findings": [f.to_json() for f in findings], "notes": ev.notes,
            "requests_in_run": len(ev.records) or None, "profiles": ev.profiles, "policy": ev.policy}


def as_markdown(findings: list[Finding], ev: Evidence) -> str:
    lines = [f"Evidence: {ev.source or 'none'}; health: {(ev.health or {}).get('status', 'unknown')}."]
    if not findings:
        lines.append("\nNo symptom found.")
    else:
        lines += ["", "| symptom | workload | evidence | what fits |", "|---|---|---|---|"]
        lines += [f"| **{f.title}** (`{f.symptom}`) | {f.workload or '-'} | {_cell(f.evidence)} | {_cell(f.fix)} |"
                  for f in findings]
    lines += [f"\nNote: {note}" for note in ev.notes]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def print_findings(findings: list[Finding], ev: Evidence) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]pdcluster doctor[/] - evidence: {ev.source or 'none'}; "
                  f"health: {(ev.health or {}).get('status', 'unknown')}")
    if not findings:
        console.print("[green]No symptom found.[/]")
    else:
        table = Table(show_lines=True)
        for column in ("symptom", "evidence", "what fits"):
            table.add_column(column, overflow="fold")
        for f in findings:
            name = f"[bold]{f.title}[/]\n{f.symptom}" + (f"\n({f.workload})" if f.workload else "")
            table.add_row(name, f.evidence, f.fix)
        console.print(table)
    for note in ev.notes:
        console.print(f"[dim]note: {note}[/]")
