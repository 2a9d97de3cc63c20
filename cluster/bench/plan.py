"""`pdcluster bench plan --json`: the planner's predictions against real runs here.

Two deployments of the tiny preset run side by side on one local Ray, each with two
single-threaded engine replicas: `colocated` (2 decode replicas, every request local)
and `pd` (1 prefill + 1 decode, routed by `--pd-mode`, `auto` by default). On each of
two workloads (the load tester's built-ins, `chat-short` and `rag-long`; SLOs are
`SLO_SCALE` times one request alone, `cluster.bench.sizing.class_slo`):

1. a real saturation search: open-loop load tests at rising rates, each about
   `--num-requests` requests, until the highest rate meeting the SLO (90% of requests
   meet both limits) is bracketed to `rel_tol`;
2. real runs at 30%, 60% and 85% of the capacity found (and, first, a few requests at
   1/s on each deployment, alone in flight: the per-request overhead outside the engine);
3. `plan validate` over all of them: each run replayed in the simulator with the
   calibration fitted from the records of that deployment's runs, each search re-run in
   the simulator, the deployments ranked by both.

Progress goes to stderr, the JSON object alone to stdout: `results`, `ratios` and
`targets` as in `bench cluster`.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import typer

from cluster.bench.cluster import stdout_to_stderr

WORKLOADS = ("chat-short", "rag-long")
LOADS = (0.3, 0.6, 0.85)  # fractions of the measured saturation rate
JUDGED_LOADS = (0.3, 0.6)  # the replay targets hold here; 85% is reported, not judged
TARGETS = {"ttft_p50_ms": 0.15, "ttft_p90_ms": 0.25, "itl_p50_ms": 0.10, "tpot_p50_ms": 0.10}
SATURATION_TARGET = 0.10
HELD_OUT_TARGET = 0.10
DEPLOYMENTS = ("colocated", "pd")
MANIFEST = "measured.json"  # what the measuring part ran, for `--from` to score again
SLO_SCALE = 10.0  # each objective is this many times one request alone
# Before the searches, a few requests one at a time on each deployment: requests alone in
# flight are what calibration measures the per-request overhead outside the engine on.
PROBE_WORKLOAD, PROBE_RATE, PROBE_REQUESTS = "chat-short", 1.0, 16


@dataclass
class PlanBenchOptions:
    preset: str = "tiny"
    model_cache: str | None = None
    num_requests: int = 150
    workloads: tuple[str, ...] = WORKLOADS
    pd_mode: str = "auto"
    factor: float = 1.3  # the search's step
    rel_tol: float = 0.07  # the search's end: bracket width relative to its low end
    loads: tuple[float, ...] = LOADS
    out: Path = Path("runs/bench-plan")
    start_rates: dict[str, float] = field(default_factory=dict)


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("plan")(bench_plan_cmd)


def bench_plan_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    quick: bool = typer.Option(False, "--quick", help="Smoke-test size: fewer requests per run, a coarser "
                               "search, one load point."),
    num_requests: int = typer.Option(150, min=20, help="Requests per run."),
    workloads: str = typer.Option(",".join(WORKLOADS), help="Comma-separated built-in workloads to run."),
    pd_mode: str = typer.Option("auto", help="The pd deployment's routing mode (auto, threshold, disagg)."),
    preset: str = typer.Option("tiny", help="Embedded model preset."),
    model_cache: str | None = typer.Option(None, help="Where the preset is made once (default ~/.cache/pdcluster)."),
    out: Path = typer.Option(Path("runs/bench-plan"), "--out", help="Folder for every run and the validation."),
    from_dir: Path | None = typer.Option(None, "--from", help="Measure nothing: score an earlier run's folder "
                                         f"(its {MANIFEST}) again with this version of the planner."),
) -> None:
    """Saturation searches and runs at 30/60/85% of capacity on real 1P+1D and 2-colocated
    deployments, each replayed by the planner: predicted vs measured."""
    from rich.console import Console

    if pd_mode not in ("auto", "threshold", "disagg"):
        raise typer.BadParameter("choose auto, threshold or disagg", param_hint="--pd-mode")
    names = tuple(w.strip() for w in workloads.split(",") if w.strip())
    if not names or any(w not in ("chat-short", "rag-long", "shared-prefix", "multi-turn", "mixed") for w in names):
        raise typer.BadParameter("built-in workloads: chat-short, rag-long, shared-prefix, multi-turn, mixed",
                                 param_hint="--workloads")
    opts = PlanBenchOptions(preset, model_cache, num_requests, names, pd_mode=pd_mode, out=out)
    if quick:
        opts.num_requests, opts.rel_tol, opts.loads = min(num_requests, 40), 0.3, (0.5,)
    console = Console(stderr=True, log_path=False)
    try:
        with stdout_to_stderr():
            result = (score(json.loads((from_dir / MANIFEST).read_text()), opts, console.log) if from_dir
                      else run_bench(opts, console.log))
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        console.print(f"[red]bench plan failed:[/] {e}")
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result))
    else:
        print_report(result)


def run_bench(opts: PlanBenchOptions, log) -> dict:
    manifest = measure(opts, log)
    (opts.out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return score(manifest, opts, log)


def score(manifest: dict, opts: PlanBenchOptions, log) -> dict:
    """`plan validate` over a measured manifest's runs, as the bench's report."""
    from cluster.plan.validate import validate

    started = time.perf_counter()
    out = Path(manifest["out"])
    loads = {(w, n, f): out / rel for w, n, f, rel in manifest["loads"]}
    log("replaying every run in the simulator")
    paths = [out / rel for rel in manifest["searches"] + manifest["probes"]] + list(loads.values())
    validation = validate(paths, log=log)
    (out / "validation.json").write_text(json.dumps(validation, indent=1) + "\n")
    return {"bench": "plan", **build_report(validation, loads, opts), "setup": manifest["setup"],
            "machine": manifest["machine"], "measure_time_s": manifest["measure_time_s"],
            "replay_time_s": round(time.perf_counter() - started, 1),
            "run_time_s": round(manifest["measure_time_s"] + time.perf_counter() - started, 1)}


def measure(opts: PlanBenchOptions, log) -> dict:
    """Deploy, probe, search and run; the manifest of what ran (paths relative to `out`)."""
    import ray.serve  # noqa: F401 - read before LocalCluster changes Serve's environment

    from cluster.bench.policy_admin import admin_token_file
    from cluster.local.ray_cluster import LocalCluster

    started, load_start = time.perf_counter(), os.getloadavg()
    with admin_token_file() as (token_file, token), LocalCluster(log=log) as cluster:
        baseline, runners = _deploy(cluster, opts, token_file, token, log)
        probes = _probe(runners, baseline, opts.out, log)
        searches, loads = _search_and_load(runners, baseline, opts, log)
    return {"out": str(opts.out), "probes": probes, "searches": searches, "loads": loads,
            "setup": {"preset": opts.preset, "num_requests": opts.num_requests, "workloads": list(opts.workloads),
                      "pd_mode": opts.pd_mode, "search": {"factor": opts.factor, "rel_tol": opts.rel_tol},
                      "loads": list(opts.loads), "baseline": vars(baseline), "slo_scale": SLO_SCALE,
                      "out": str(opts.out),
                      "deployments": {"colocated": "2 decode replicas, every request local",
                                      "pd": f"1 prefill + 1 decode, x-pd-mode {opts.pd_mode}"}},
            "machine": {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "measure_time_s": round(time.perf_counter() - started, 1)}


def _deploy(cluster, opts: PlanBenchOptions, token_file: str, token: str, log):
    from cluster.bench.plan_runs import Runner
    from cluster.bench.sizing import measure_baseline
    from cluster.local.apps import app_args, ensure_preset, expected_pools
    from cluster.local.runs import warm_up

    ensure_preset(opts.preset, opts.model_cache, log)
    log(f"deploying colocated (2 decode replicas, local) and pd (1 prefill + 1 decode, {opts.pd_mode})")
    urls = dict(zip(DEPLOYMENTS, cluster.deploy_many([
        ("colocated", app_args(opts.preset, opts.model_cache, 0, 2, "local", admin_token_file=token_file),
         "/colocated", expected_pools(0, 2)),
        ("pd", app_args(opts.preset, opts.model_cache, 1, 1, opts.pd_mode, admin_token_file=token_file),
         "/pd", expected_pools(1, 1)),
    ]), strict=True))
    warm_up(urls["colocated"], ("local",))
    warm_up(urls["pd"], ("local", "disagg"))
    baseline = measure_baseline(urls["colocated"])
    log(f"baseline (one request alone on one replica): {baseline}")
    seeds = itertools.count(1000)
    return baseline, {"colocated": Runner(urls["colocated"], token, "local", seeds, log),
                      "pd": Runner(urls["pd"], token, opts.pd_mode, seeds, log)}


def _probe(runners: dict, baseline, out: Path, log) -> list[str]:
    probes = []
    for name in DEPLOYMENTS:
        log(f"{name}: {PROBE_REQUESTS} requests at {PROBE_RATE:g}/s (the overhead outside the engine)")
        probes.append(f"probe/{name}")
        runners[name].run(PROBE_WORKLOAD, PROBE_RATE, PROBE_REQUESTS, workload_slo(baseline, PROBE_WORKLOAD),
                          out / probes[-1])
    return probes


def _search_and_load(runners: dict, baseline, opts: PlanBenchOptions, log) -> tuple[list[str], list[list]]:
    from cluster.bench.plan_runs import search
    from cluster.plan.validate import bracket_middle

    searches, loads = [], []
    for workload in opts.workloads:
        slo = workload_slo(baseline, workload)
        for name in DEPLOYMENTS:
            log(f"{workload} on {name}: saturation search (SLO {slo.as_dict()})")
            searches.append(f"{workload}/{name}/search")
            found = search(runners[name], workload, opts.num_requests, slo, start_rate(baseline, workload, name),
                           opts.factor, opts.rel_tol, opts.out / searches[-1])
            capacity = bracket_middle(found["rate"], found["high"])
            if capacity is None:
                log(f"  {workload} on {name}: no rate met the SLO; no load points")
                continue
            for fraction in opts.loads:
                rel = f"{workload}/{name}/load-{round(fraction * 100)}"
                point = runners[name].run(workload, capacity * fraction, opts.num_requests, slo, opts.out / rel)
                loads.append([workload, name, fraction, rel])
                log(f"  {workload} on {name} at {fraction:.0%} ({point.rate:.3g} req/s): "
                    f"{point.attainment:.0%} met the SLO, TTFT p50 {point.figures['ttft_p50_ms'] or 0:.0f} ms")
    return searches, loads


def workload_slo(baseline, workload: str):
    """`SLO_SCALE` times one request alone: a long prompt's TTFT for `rag-long`, a short
    one's else, and a lone stream's TPOT. Loose enough that only real queueing breaks it
    (a tight TTFT objective on two shared cores is missed by scattered requests at any
    rate, and the "highest rate that meets it" turns to noise)."""
    from cluster.bench.sizing import class_slo

    return class_slo(baseline, "long" if workload == "rag-long" else "short", SLO_SCALE, SLO_SCALE)


def start_rate(baseline, workload: str, deployment: str) -> float:
    """Where the search starts: the replicas that run requests, each serving one at a
    time as fast as one alone (batching takes it higher, queueing for the SLO lower)."""
    serving = 2.0 if deployment == "colocated" else 1.5  # a prefill replica takes part of the work
    output_len = 24 if workload == "rag-long" else 40  # the built-ins' mean output lengths
    ttft_ms = baseline.ttft_long_ms if workload == "rag-long" else baseline.ttft_short_ms
    return round(serving / ((ttft_ms + (output_len - 1) * baseline.tpot_ms) / 1000.0), 3)


def build_report(validation: dict, loads: dict, opts: PlanBenchOptions) -> dict:
    runs = {row["run"]: row for row in validation["runs"]}
    results: dict = {}
    ratios: dict = {}
    for s in validation["searches"]:
        workload, name = s["workload"], Path(s["search"]).parent.name
        block = results.setdefault(workload, {}).setdefault(name, {"loads": {}})
        block["saturation"] = {"measured": s["measured"]["estimate"], "bracket": [s["measured"]["rate"],
                               s["measured"]["high"]], "predicted": s["predicted"]["rate"], "error": s["error"]}
        ratios[f"{workload}_{name}_saturation_error"] = s["error"]
    for (workload, name, fraction), run_dir in loads.items():
        row = runs[str(run_dir)]
        pct = round(fraction * 100)
        results[workload][name]["loads"][str(pct)] = {"rate": row["rate"], "figures": row["figures"],
                                                      "routes": row["routes"]}
        for figure in (*TARGETS, "itl_p99_ms", "throughput_rps", "goodput_rps"):
            ratios[f"{workload}_{name}_load{pct}_{figure}_error"] = row["figures"][figure]["error"]
    for name, c in validation["calibrations"].items():  # the step model's work alone, and the node's wait
        ratios[f"held_out_work_error_{name}"] = c.get("held_out_work_median_error")
        ratios[f"same_shape_step_spread_{name}"] = c.get("same_shape_spread")
        ratios[f"run_wait_share_{name}"] = c.get("run_wait_share")
    targets = _targets(results, validation, opts)
    return {"results": results, "ratios": ratios, "targets": targets, "rankings": validation["rankings"],
            "calibrations": validation["calibrations"]}


def _targets(results: dict, validation: dict, opts: PlanBenchOptions) -> dict:
    targets = {}
    judged = [str(round(f * 100)) for f in opts.loads if any(abs(f - j) < 1e-9 for j in JUDGED_LOADS)]
    for figure, limit in TARGETS.items():  # a point that did not run (no capacity found) counts as a miss
        errors = [block["loads"][pct]["figures"][figure]["error"] if pct in block["loads"] else None
                  for by_name in results.values() for block in by_name.values() for pct in judged]
        targets[f"replay_{figure}_max_abs_error"] = _target(_max_abs(errors), limit)
    errors = [block["saturation"]["error"] for by_name in results.values() for block in by_name.values()]
    targets["saturation_rate_max_abs_error"] = _target(_max_abs(errors), SATURATION_TARGET)
    for workload, ranking in validation["rankings"].items():
        targets[f"ranking_{workload}"] = {"target": "same order as measured (5% ties)", "value": ranking,
                                          "met": ranking["agree"]}
    for name, c in validation["calibrations"].items():
        targets[f"held_out_step_error_{name}"] = _target(c["held_out_median_error"], HELD_OUT_TARGET)
    return targets


def _max_abs(errors: list) -> float | None:
    return None if not errors or any(e is None for e in errors) else round(max(abs(e) for e in errors), 4)


def _target(value: float | None, limit: float) -> dict:
    return {"target": f"<= {limit:g}", "value": value, "met": value is not None and value <= limit}


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="bench plan: predicted vs measured")
    for col in ("workload", "deployment", "point", "figure", "measured", "predicted", "error"):
        table.add_column(col)
    for workload, by_name in result["results"].items():
        for name, block in by_name.items():
            s = block["saturation"]
            table.add_row(workload, name, "saturation", "req/s", _fmt(s["measured"]), _fmt(s["predicted"]),
                          _fmt(s["error"]))
            for pct, load in block["loads"].items():
                for figure, f in load["figures"].items():
                    table.add_row(workload, name, f"{pct}%", figure, _fmt(f["measured"]), _fmt(f["predicted"]),
                                  _fmt(f["error"]))
    console.print(table)
    for key, t in result["targets"].items():
        console.print(f"{'met ' if t['met'] else 'MISS'} {key}: {t['value']} ({t['target']})")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"
