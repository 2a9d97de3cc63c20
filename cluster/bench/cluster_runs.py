"""The cluster benchmark's load runs: every (repeat, workload, configuration), then the
two scenarios, each run's figures, requests, the router's decisions and (for `auto`) its
own prediction error.

Configurations: `colocated` (the colocated app, mode local), `disagg` and `threshold`
(the pd app, that mode), and `auto` once per SLO cell (the pd app, mode auto, its class
profiles carrying that cell's SLOs). Before an `auto` run the class profiles are set and
the policy reset (its corrections and its prediction-error window), so each `auto` run
starts from the replicas' step models alone and its error covers its own requests.

Every run, whatever its configuration, keeps the router's log of its requests
(`decisions.json`) and reads from it the router-side TTFT (arrival to first token) and the
called worker's own, beside the client's: a TTFT gap between two configurations then
splits into the route (the worker's TTFT), the router and the HTTP path.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench.cluster_scenarios import disagg_hurts, fault_at_s, fault_delay_s, load_shift
from cluster.bench.policy_admin import PolicyAdmin, set_prefill_faults
from cluster.bench.router_side import router_side_figures, run_decisions
from cluster.bench.sizing import Baseline
from cluster.bench.slo_cells import BALANCED, CELLS, FIXED_CONFIGS, auto_config, cell_slos
from cluster.local.traffic import ClusterWorkload

PAUSE_S = 1.0  # between runs: heartbeats catch up, the next run starts from an idle view


@dataclass(frozen=True)
class Config:
    name: str
    app: str
    mode: str  # x-pd-mode
    cell: str | None = None  # auto: the SLO cell its class profiles carry


FIXED = tuple(Config(c, "colocated" if c == "colocated" else "pd", "local" if c == "colocated" else c)
              for c in FIXED_CONFIGS)
CONFIGS = FIXED + tuple(Config(auto_config(cell), "pd", "auto", cell) for cell in CELLS)
SCENARIO_CONFIGS = (*FIXED, Config("auto", "pd", "auto", BALANCED))
# The order the scenarios run them in: `auto` first on the pd app, so that no run before
# it has left a faulted link in the prefill replica's transfer fit (which `auto` reads and
# the fixed configurations do not). Seeds stay with the configuration, not the order.
SCENARIO_ORDER = ("colocated", "auto", "disagg", "threshold")


@dataclass
class RunResult:
    figures: dict
    records: list  # RequestRecords
    prediction_error: dict | None = None  # auto: GET /admin/policy's, over this run
    fault_at_s: float | None = None  # disagg_hurts on the pd app: when the fault went on
    num_delayed_layers: int | None = None  # ... and how many KV layers it delayed


@dataclass
class Bench:
    """What every run needs: the apps' URLs and admin APIs, the baseline."""

    urls: dict[str, str]
    admins: dict[str, PolicyAdmin]  # per app; the pd app's also sets `auto`'s SLOs and resets its policy
    baseline: Baseline
    out: Path
    log: object = print
    probe: object = field(default=None)
    save_steps_token: str | None = None  # set: each run folder gets the app's step and transfer records

    def __post_init__(self) -> None:
        from cluster.bench.cpu_probe import CpuProbe

        self.probe = CpuProbe.for_serve()

    @property
    def admin(self) -> PolicyAdmin:
        return self.admins["pd"]

    def run(self, config: Config, workload: ClusterWorkload, out_dir: Path, seed: int,
            on_record=None) -> RunResult:
        from cluster.local.runs import run_workload

        if config.cell is not None:
            self.admin.set_slos(cell_slos(self.baseline, config.cell, [c.name for c in workload.classes]))
            self.admin.reset()
        before, started_at = self.probe.sample(), time.time()
        with self._saving_steps(config.app, out_dir):
            run = run_workload(self.urls[config.app], workload, config.mode, out_dir, seed, on_record=on_record)
        figures = dict(run.figures(), cpu_s=self.probe.used(before))
        admin = self.admins.get(config.app)
        if admin is not None:  # how each request went through the router, kept beside the run
            log = run_decisions(admin.decisions(), started_at)
            (out_dir / "decisions.json").write_text(json.dumps(log, indent=1) + "\n")
            figures.update(router_side_figures(log["decisions"], [r.request_id for r in run.records]))
        error = None
        if config.cell is not None:  # what the policy learned and how far off it was, kept beside the run
            policy = self.admin.describe()
            (out_dir / "policy.json").write_text(json.dumps(policy, indent=1) + "\n")
            error = policy.get("prediction_error", {})
        time.sleep(PAUSE_S)
        return RunResult(figures, run.records, error)

    def _saving_steps(self, app: str, out_dir: Path):
        if self.save_steps_token is None:
            return contextlib.nullcontext()
        from cluster.plan.live import saving_steps

        return saving_steps(self.urls[app], out_dir, self.save_steps_token)


def run_workloads(bench: Bench, workloads: dict[str, ClusterWorkload], repeats: int) -> dict[str, dict]:
    """`{workload: {config: [RunResult per repeat]}}`; configurations rotated each repeat."""
    runs: dict[str, dict[str, list[RunResult]]] = {name: {c.name: [] for c in CONFIGS} for name in workloads}
    total, done = repeats * len(workloads) * len(CONFIGS), 0
    for repeat in range(repeats):
        shift = repeat % len(CONFIGS)
        order = CONFIGS[shift:] + CONFIGS[:shift]
        for w_index, (name, workload) in enumerate(workloads.items()):
            for c_index, config in enumerate(order):
                seed = 10_000 * (repeat + 1) + 100 * w_index + c_index
                result = bench.run(config, workload, run_folder(bench.out, repeat, name, config.name), seed)
                runs[name][config.name].append(result)
                done += 1
                bench.log(f"[{done}/{total}] repeat {repeat} {name:15s} {_line(config, result)}")
    return runs


def run_folder(out: Path, repeat: int, workload: str, config: str) -> Path:
    """Where one repeat of a workload in a configuration keeps its records."""
    return out / f"r{repeat}" / workload / config


def run_folders(out: Path, workloads: Iterable[str], repeats: int) -> dict[str, Path]:
    """`{"r<repeat>/<workload>/<config>": folder}` of every run `run_workloads` makes."""
    return {f"r{repeat}/{name}/{c.name}": run_folder(out, repeat, name, c.name)
            for repeat in range(repeats) for name in workloads for c in CONFIGS}


def run_scenarios(bench: Bench, prompt_factor: float, span_s: float, num_long: int, half_s: float,
                  num_layers: int) -> dict[str, dict]:
    """Both scenarios in every configuration: `{scenario: {"workload", "delay_s"?, "runs":
    {config: RunResult}}}`."""
    b = bench.baseline
    hurts = disagg_hurts(b, span_s, num_long).scaled(prompt_factor=prompt_factor)
    shift = load_shift(b, half_s).scaled(prompt_factor=prompt_factor)
    delay_s = fault_delay_s(b, num_layers)
    out: dict[str, dict] = {}
    # The load shift first: after the fault, the prefill replica's transfer model and the
    # router's corrections remember the slowed KV path for a minute or more (as they
    # should in production), which would price the next scenario's remote route as slow.
    for s_index, workload in ((1, shift), (0, hurts)):
        for line in workload.describe():
            bench.log(line)
        runs = {}
        by_name = {c.name: (i, c) for i, c in enumerate(SCENARIO_CONFIGS)}
        for c_index, config in (by_name[name] for name in SCENARIO_ORDER):
            out_dir, seed = bench.out / "scenarios" / workload.name / config.name, 90_000 + 100 * s_index + c_index
            if workload is hurts and config.app == "pd":
                with FaultSwitch(config.app, fault_at_s(workload), delay_s) as switch:
                    result = bench.run(config, workload, out_dir, seed, on_record=switch.on_record)
                result.fault_at_s, result.num_delayed_layers = switch.switched_at_s, switch.num_delayed_layers
            else:
                result = bench.run(config, workload, out_dir, seed)
            runs[config.name] = result
            bench.log(f"scenario {workload.name:12s} {_line(config, result)}")
        out[workload.name] = {"workload": workload, "runs": runs}
    out[hurts.name].update(delay_s=delay_s, num_layers=num_layers, planned_fault_at_s=fault_at_s(hurts))
    return out


class FaultSwitch:
    """Turns the KV layer delay on at `at_s` on the load test's clock and off on exit.

    The load tester's time 0 is not visible from outside; a request's record says when
    it ended on that clock, so the first record to end gives time 0 to a millisecond."""

    def __init__(self, app: str, at_s: float, delay_s: float) -> None:
        self.app, self.at_s, self.delay_s = app, at_s, delay_s
        self.base: float | None = None
        self.switched_at_s: float | None = None
        self.num_delayed_layers: int | None = None  # while it was on (the replicas count since they started)
        self._delayed_before = 0
        self.error: BaseException | None = None
        self._known, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-switch", daemon=True)

    def on_record(self, record) -> None:
        if self.base is None:
            self.base = time.perf_counter() - record.ended_at_s
            self._known.set()

    def _run(self) -> None:
        self._known.wait()
        if self._stop.is_set() or self._stop.wait(max(0.0, self.base + self.at_s - time.perf_counter())):
            return
        try:
            start = time.perf_counter()
            states = set_prefill_faults(self.app, {"kv_layer_delay_s": self.delay_s})
            self.switched_at_s = round((start + time.perf_counter()) / 2 - self.base, 3)
            self._delayed_before = _num_delayed(states)
        except Exception as e:  # noqa: BLE001 - re-raised on the bench's thread at exit
            self.error = e

    def __enter__(self) -> FaultSwitch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._known.set()
        self._thread.join()
        states = set_prefill_faults(self.app, {})  # every fault off; each replica says what it did
        if self.switched_at_s is not None:
            self.num_delayed_layers = _num_delayed(states) - self._delayed_before
        if self.error is not None:
            raise RuntimeError(f"switching the KV layer delay on failed: {self.error!r}")
        if self.switched_at_s is None and exc[0] is None:
            raise RuntimeError("the run ended before the fault was due")


def _num_delayed(states: list[dict]) -> int:
    return sum(state.get("num_delayed_layers", 0) for state in states)


def _line(config: Config, result: RunResult) -> str:
    f = result.figures
    return (f"{config.name:15s} TTFT p50 {f['ttft_p50_ms'] or 0:8.1f} ITL p99 {f['itl_p99_ms'] or 0:8.1f} "
            f"goodput {f['goodput_rps'] or 0:.3f}/s failed {f['failed']} routes {f['routes']}")
