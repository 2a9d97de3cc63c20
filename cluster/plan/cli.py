"""`pdcluster plan ...`: the planner's commands, one typer group. `plan calibrate` fits the
step and transfer models from a live deployment, run directories, or an offline sweep of
the engine on this machine. Heavy modules load only when a command runs."""

from __future__ import annotations

import json
from pathlib import Path

import typer

plan_app = typer.Typer(invoke_without_command=True, add_completion=False,
                       help="Capacity planning: calibrate the engine's costs, simulate a cluster, recommend a split.")
DEFAULT_OUT_DIR = Path("runs/plan")


@plan_app.callback()
def plan_main(
    ctx: typer.Context,
    workload: str | None = typer.Option(None, help="A built-in workload (chat-short, rag-long, shared-prefix, "
                                        "multi-turn, mixed), a workload file, or a trace.jsonl."),
    rate: float | None = typer.Option(None, min=0.0, help="Arrival rate to plan for, requests/s."),
    slo: str | None = typer.Option(None, help="ttft_ms=X,tpot_ms=Y: a request is good when it meets both."),
    replicas: int | None = typer.Option(None, min=1, help="Replicas to split between prefill and decode."),
    calibration: Path | None = typer.Option(None, help="A calibration file (`plan calibrate`); default: the "
                                            "embedded tiny model calibrated on this machine, cached."),
    num_requests: int = typer.Option(1000, min=20, help="Simulated requests per configuration and rate."),
    seed: int = typer.Option(0, help="Workload and simulation seed."),
    rate_sweep: bool = typer.Option(False, "--rate-sweep", help="Find every configuration's saturation rate "
                                    "(default: the best few, colocated and the best disaggregated one)."),
    replicas_per_node: int = typer.Option(8, min=1, help="Replicas sharing one node's NIC."),
    model_path: str | None = typer.Option(None, help="Model folder to name in the recommended config."),
    out: Path | None = typer.Option(None, help="Write plan.json, points.jsonl, PNG plots and the recommended "
                                    "cluster config here."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Capacity planning: calibrate the engine's costs, simulate a cluster, recommend a split.

    With --workload, --rate, --slo and --replicas: simulate every prefill:decode split of
    the replicas (and all-colocated) under each routing mode, rank them by goodput per
    replica, and recommend one that meets the SLO with 15% headroom."""
    if ctx.invoked_subcommand is not None:
        return
    given = [workload, rate, slo, replicas]
    if all(v is None for v in given):
        typer.echo(ctx.get_help())
        return
    if any(v is None for v in given):
        _fail("plan needs --workload, --rate, --slo and --replicas together", "plan")
    _plan(workload, rate, slo, replicas, calibration, num_requests, seed, rate_sweep, replicas_per_node,
          model_path, out, as_json)


def _plan(workload: str, rate: float, slo: str, replicas: int, calibration: Path | None, num_requests: int,
          seed: int, rate_sweep: bool, replicas_per_node: int, model_path: str | None, out: Path | None,
          as_json: bool) -> None:
    from cluster.plan.calibration import Calibration
    from cluster.plan.command import PlanArgs, plan
    from cluster.plan.evaluate import Workload, load_slo

    try:
        objective = load_slo(slo)
        if rate <= 0:
            raise ValueError("--rate must be > 0")
        if calibration is not None:
            cal, cal_path = Calibration.load(calibration), str(calibration)
        else:
            cal_path = str(_default_calibration_file(as_json))
            cal = Calibration.load(cal_path)
        args = PlanArgs(Workload(workload, num_requests, seed), rate, objective, replicas, rate_sweep,
                        replicas_per_node, model_path, out, as_json)
        data = plan(args, cal, cal_path, log=(lambda _: None) if as_json else (lambda m: typer.echo(m, err=True)))
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e), "plan")
    if as_json:
        typer.echo(json.dumps(data))
    elif out is not None:
        typer.echo(f"wrote {', '.join(data['files'].values())}")


def _default_calibration_file(quiet: bool) -> Path:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster.plan.default import default_calibration_file

    with Progress(TextColumn("calibrating the tiny model (first use only)"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=quiet, transient=True) as progress:
        task = progress.add_task("sweep", total=None)
        return default_calibration_file(on_grid=lambda n: progress.update(task, total=n),
                                        on_point=lambda done, total: progress.update(task, completed=done))


@plan_app.command("calibrate")
def calibrate_cmd(
    url: str | None = typer.Option(None, help="A live deployment (GET /admin/steps; token from PDC_ADMIN_TOKEN)."),
    run: list[Path] = typer.Option([], "--run", help="A run folder with steps.jsonl (repeatable): "
                                   "`loadtest --save-steps` writes one."),
    model: Path | None = typer.Option(None, help="Model folder: with neither --url nor --run, sweep the engine "
                                      "on it here; otherwise only its layers and KV size are read."),
    device: str | None = typer.Option(None, help="cpu or cuda: the sweep's device (default cpu); live/run: "
                                      "used only where the deployment did not report it."),
    dtype: str | None = typer.Option(None, help="float32 (the sweep's default), bfloat16 or float16; live/run: "
                                     "used only where the deployment did not report it."),
    threads: int = typer.Option(1, min=1, help="Sweep: torch threads (a pool's default torch_threads is 1)."),
    max_points: int | None = typer.Option(None, min=3, help="Sweep: at most this many grid points."),
    block_size: int | None = typer.Option(None, min=1, help="Run/live: where the deployment did not report it."),
    num_kv_blocks: int | None = typer.Option(None, min=1, help="Run/live: where the deployment did not report it."),
    max_num_seqs: int | None = typer.Option(None, min=1, help="Run/live: where the deployment did not report it."),
    max_num_batched_tokens: int | None = typer.Option(None, min=1, help="Run/live: where the deployment did not "
                                                      "report it."),
    node_contention: bool = typer.Option(False, "--node-contention", help="Run/live: also fit how much a busy "
                                         "neighbour replica on the same machine slows a step (the policy's own "
                                         "fit does); off, the simulator's serving-path queue holds that share."),
    out: Path | None = typer.Option(None, help=f"The calibration file (default {DEFAULT_OUT_DIR}/"
                                    "calibration-MODEL-SOURCE.json)."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration as JSON on stdout."),
) -> None:
    """Fit the step-cost and KV transfer models and score the step model on held-out records."""
    from cluster.plan.calibrate import CalibrationError, Overrides, from_live, from_runs
    from cluster.plan.live import AdminError

    sources = sum([url is not None, bool(run)])
    if sources > 1 or (sources == 0 and model is None):
        _fail("give one source: --url URL, --run DIR (repeatable), or --model DIR for an offline sweep")
    overrides = Overrides(str(model) if model else None, device, dtype, block_size, num_kv_blocks,
                          max_num_seqs, max_num_batched_tokens, node_contention)
    try:
        if url is not None:
            calibration = from_live(url, overrides=overrides)
        elif run:
            calibration = from_runs(run, overrides)
        else:
            calibration = _sweep(model, device or "cpu", dtype or "float32", threads, max_points, quiet=as_json)
    except (CalibrationError, AdminError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    path = calibration.save(out or DEFAULT_OUT_DIR / f"calibration-{calibration.model}-{calibration.source}.json")
    if as_json:
        typer.echo(json.dumps({**calibration.model_dump(), "path": str(path)}))
    else:
        _print_summary(calibration, path)


@plan_app.command("validate")
def validate_cmd(
    runs: list[Path] = typer.Argument(..., help="Run folders (`loadtest --rate/--trace ... --save-steps`) and "
                                      "saturation searches (folders with saturation.json, `bench plan`)."),
    calibration: Path | None = typer.Option(None, help="A calibration file for every run (default: fitted "
                                            "from the records of the runs on each deployment)."),
    out: Path | None = typer.Option(None, help="Write validation.json here."),
    as_json: bool = typer.Option(False, "--json", help="Print the validation as JSON on stdout."),
) -> None:
    """Replay real runs in the simulator and set its figures beside the measured ones:
    TTFT p50/p90, ITL p50/p99, TPOT p50, throughput, goodput, saturation rate."""
    from cluster.plan.calibrate import CalibrationError
    from cluster.plan.calibration import Calibration
    from cluster.plan.replay import ReplayError
    from cluster.plan.validate import validate

    log = (lambda _: None) if as_json else (lambda m: typer.echo(m, err=True))
    try:
        given = Calibration.load(calibration) if calibration is not None else None
        data = validate(runs, given, log)
    except (ReplayError, CalibrationError, FileNotFoundError, ValueError) as e:
        _fail(str(e), "plan validate")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(json.dumps(data, indent=1) + "\n")
    if as_json:
        typer.echo(json.dumps(data))
    else:
        _print_validation(data)


def _print_validation(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="predicted vs measured (error = predicted / measured - 1)")
    for col in ("run", "figure", "measured", "predicted", "error"):
        table.add_column(col)
    for row in data["runs"]:
        for figure, f in row["figures"].items():
            table.add_row(Path(row["run"]).name, figure, _num(f["measured"]), _num(f["predicted"]), _num(f["error"]))
    for s in data["searches"]:
        table.add_row(Path(s["search"]).name, "saturation req/s", _num(s["measured"]["estimate"]),
                      _num(s["predicted"]["rate"]), _num(s["error"]))
    Console().print(table)
    for workload, r in data["rankings"].items():
        typer.echo(f"{workload}: measured {' > '.join(r['measured'])}, predicted {' > '.join(r['predicted'])}"
                   f" ({'agree' if r['agree'] else 'DISAGREE'})")


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _sweep(model: Path, device: str, dtype: str, threads: int, max_points: int | None, quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster.plan.sweep_source import from_sweep

    # Redrawn between points only: rich's refresh thread would take the GIL in the middle
    # of the steps being timed (it raised the tiny model's held-out error from ~8% to ~14%).
    with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=quiet, auto_refresh=False) as progress:
        task = progress.add_task("sweep", total=None)
        return from_sweep(model, device, dtype, threads, max_points,
                          on_point=lambda done, total: progress.update(task, completed=done, total=total,
                                                                       refresh=True))


def _print_summary(c, path: Path) -> None:
    s, q = c.step, c.quality
    typer.echo(f"{c.model} on {c.device} ({c.dtype}), source {c.source}, engine {c.engine_version}")
    typer.echo(f"step model: {s.fixed_s * 1e3:.3f} ms + {s.prefill_token_s * 1e6:.3f} us/prompt token "
               f"+ {s.prefill_attention_s * 1e9:.3f} ns/attention unit + {s.decode_seq_s * 1e6:.2f} us/decode seq "
               f"+ {s.decode_context_s * 1e9:.2f} ns/context token")
    typer.echo(f"held-out error: median {q.median_relative_error:.1%}, p90 {q.p90_relative_error:.1%} "
               f"({q.num_held_out} held out, {q.num_fitted} fitted)")
    if q.work_median_relative_error is not None:
        typer.echo(f"work alone (CPU time): median error {q.work_median_relative_error:.1%}; "
                   f"steps waited {q.run_wait_share:.0%} of their CPU time for a core")
    if q.same_shape_spread is not None:
        typer.echo(f"steps alike scatter by {q.same_shape_spread:.1%} (median, {q.same_shape_share:.0%} of the "
                   f"steps): about the least error any step model can have on these records")
    bandwidth = "no per-byte cost" if c.transfer.bytes_per_s is None else f"{c.transfer.bytes_per_s / 1e6:.1f} MB/s"
    typer.echo(f"transfer: {c.transfer.fixed_s * 1e3:.2f} ms + {bandwidth} ({c.transfer.num_samples} samples); "
               f"request overhead {c.request_overhead_s * 1e3:.2f} ms")
    typer.echo(f"notes: {c.notes}")
    typer.echo(f"wrote {path}")


def _fail(message: str, command: str = "plan calibrate") -> None:
    typer.echo(f"{command}: {message}", err=True)
    raise typer.Exit(2)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.add_typer(plan_app, name="plan")
