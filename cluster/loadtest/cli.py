"""`pdcluster loadtest` and `pdcluster compare` (options as in INTERFACES.md). Only typer
is imported at module level so `pdcluster --help` stays fast."""

from __future__ import annotations

from pathlib import Path

import typer


def _parse_ramp(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    start, sep, end = text.partition(":")
    try:
        return float(start), float(end)
    except ValueError:
        raise typer.BadParameter("use START:END rates, e.g. 1:20", param_hint="--ramp") from None


def _parse_headers(items: list[str]) -> dict[str, str]:
    headers = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r}: use K:V", param_hint="--header")
        headers[key.strip().lower()] = value.strip()
    return headers


def loadtest_cmd(
    url: str = typer.Option(..., help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000."),
    out: Path = typer.Option(..., "--out", help="Folder for summary.json, requests.jsonl, summary.csv, PNGs."),
    workload: str = typer.Option("chat-short", help="chat-short, rag-long, shared-prefix, multi-turn, mixed, or a JSONL/YAML file."),
    rate: float | None = typer.Option(None, help="Open loop: mean arrivals per second (gamma/Poisson)."),
    burstiness: float = typer.Option(1.0, help="Gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier."),
    concurrency: int | None = typer.Option(None, help="Closed loop: requests kept in flight (default 1 when no shape is given)."),
    ramp: str | None = typer.Option(None, help="Open loop with a linear rate ramp START:END (req/s)."),
    sweep: bool = typer.Option(False, "--sweep", help="Find the saturation point and the highest rate meeting --slo."),
    trace: Path | None = typer.Option(None, help="Replay a JSONL trace with 'timestamp' (seconds) per row."),
    duration: float | None = typer.Option(None, help="No request starts after S seconds; in-flight ones drain."),
    num_requests: int | None = typer.Option(None, help="Requests to send (default 100 unless --duration)."),
    seed: int = typer.Option(0, help="Workload and schedule seed: same seed, byte-identical requests."),
    prompt_salt: str | None = typer.Option(None, help="Replace the first characters of every prompt with this "
                                           "text: same lengths and arrivals, no prefix-cache hits on an earlier run."),
    model: str | None = typer.Option(None, help="Model id (default: the first of /v1/models)."),
    endpoint: str = typer.Option("completions", help="completions (token-id prompts where allowed) or chat."),
    api_key: str | None = typer.Option(None, help="Sent as a Bearer token; never recorded."),
    slo: str | None = typer.Option(None, help="ttft_ms=X,tpot_ms=Y,e2e_ms=Z (any subset) for goodput."),
    clients: int = typer.Option(1, help="Spread the load over K Ray actors."),
    mode: str | None = typer.Option(None, help="auto, threshold, disagg or local: sent as x-pd-mode."),
    header: list[str] = typer.Option([], help="Extra request header K:V (repeatable)."),
    stream: bool = typer.Option(True, help="Stream responses (TTFT needs it; without, TTFT = E2E)."),
    prompt_format: str = typer.Option("auto", help="auto (probe the server), ids or text."),
    timeout: float = typer.Option(300.0, help="Seconds one request may take."),
    plots: bool = typer.Option(True, help="Write PNG plots."),
    sweep_points: int = typer.Option(5, help="--sweep: rates tried up to the saturation throughput."),
    save_steps: bool = typer.Option(False, "--save-steps", help="Also write the deployment's step and KV transfer "
                                    "records over the run (GET /admin/steps, token from PDC_ADMIN_TOKEN) as "
                                    "steps.jsonl and transfers.jsonl, for `pdcluster plan calibrate --run`."),
    save_metrics: bool = typer.Option(False, "--save-metrics", help="Also sample the server's /metrics over the "
                                      "run into the folder, for `pdcluster doctor --run`."),
) -> None:
    """Drive an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, E2E, goodput, routes."""
    from cluster.loadtest.api import run_loadtest
    from cluster.loadtest.config import SLO, LoadTestConfig
    from cluster.loadtest.report import print_summary

    try:
        config = LoadTestConfig(
            url=url, out_dir=out, workload=workload, rate=rate, burstiness=burstiness, concurrency=concurrency,
            ramp=_parse_ramp(ramp), sweep=sweep, trace=trace, duration_s=duration, num_requests=num_requests,
            seed=seed, prompt_salt=prompt_salt, model=model, endpoint=endpoint, api_key=api_key, slo=SLO.parse(slo), clients=clients,
            mode=mode, headers=_parse_headers(header), stream=stream, prompt_format=prompt_format,
            timeout_s=timeout, progress=True, plots=plots, sweep_points=sweep_points, save_steps=save_steps,
            save_metrics=save_metrics,
        )
        summary = run_loadtest(config)
    except (ValueError, RuntimeError) as e:
        typer.echo(f"loadtest: {e}", err=True)
        raise typer.Exit(2) from None
    print_summary(summary, title=f"{workload} @ {url}")
    typer.echo(f"wrote {out}/summary.json")


def compare_cmd(
    dirs: list[Path] = typer.Argument(..., help="loadtest output folders; ratios are against the first."),
    out: Path = typer.Option(..., "--out", help="Folder for compare.json, compare.csv and the PNGs."),
) -> None:
    """Side-by-side table of several runs (ratios against the first) and overlaid plots."""
    from rich.console import Console

    from cluster.loadtest.compare import compare, compare_table

    try:
        result = compare(dirs, out)
    except ValueError as e:
        typer.echo(f"compare: {e}", err=True)
        raise typer.Exit(2) from None
    Console().print(compare_table(result))
    typer.echo(f"wrote {out}/compare.json")


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("loadtest")(loadtest_cmd)
    app.command("compare")(compare_cmd)
