"""`pdcluster bench transport`: progress on stderr, the JSON object alone on stdout."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    @bench_app.command("transport")
    def bench_transport(
        json_out: bool = typer.Option(False, "--json", help="Print the JSON object on stdout."),
        sizes: str = typer.Option("1,16,64,256", help="Payload sizes in MiB, comma-separated."),
        repeats: int = typer.Option(9, min=1, help="Timed transfers per size (median; half at 256 MiB)."),
        ray: bool = typer.Option(True, help="Include the Ray object store baseline."),
        curve: bool = typer.Option(True, help="Include CurveZMQ-encrypted zmq (<= 64 MiB)."),
        overlap: bool = typer.Option(True, help="Measure the small-preset overlap tail."),
    ) -> None:
        """KV transfer GB/s for zmq, nccl (Gloo on CPU), shm vs raw TCP, Ray, memcpy."""
        from cluster.bench.transport import run

        sizes_mib = [int(s) for s in sizes.split(",") if s.strip()]
        if not sizes_mib or min(sizes_mib) < 1:
            raise typer.BadParameter("sizes must be positive MiB counts", param_hint="--sizes")
        result = run(sizes_mib, repeats, with_ray=ray, with_curve=curve, with_overlap=overlap)
        if json_out:
            typer.echo(json.dumps(result))
        else:
            for r in result["results"]:
                typer.echo(f"{r['name']:>18} {r['bytes'] >> 20:>5} MiB {r['gb_per_s']:8.3f} GB/s")
            typer.echo(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))
