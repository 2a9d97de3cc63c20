"""How fast the machine ran each run of a benchmark, from the engines' own step records.

Every step record carries the CPU time its engine thread spent on the step. One
reference step model prices every quiet step (one during which no other engine of the
node computed: the contention between replicas is something the routes cause, not the
machine); a run's factor is the median of CPU time / price over its quiet steps,
against the median run. The model and the factors are fitted in turn, the model on
every run's steps with that run's factor taken out: fitted once on them all as they
came, a slow run whose steps were mostly of one kind (decode steps, say) taught the
model that kind was dear, and its own factor came out a quarter too small. 1.2 means
the same work took a fifth more CPU time in that run than in the median one: the
machine was slower then (another process on the cores, a slower or throttled core, a
neighbour on the host), whichever route ran.

On two shared cores this factor moved by a fifth or more between runs minutes apart,
which tips a configuration near its capacity from meeting its objectives into queueing.
Two configurations whose runs' factors differ that much were not compared on equal
machines; read their cells with that in mind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from statistics import median

import numpy as np

from cluster.plan.records import STEPS_FILE, read_run_records
from workers.engine.cost_model import has_work, step_features
from workers.engine.nnls_fit import MIN_STEP_S, fit_step_coefficients
from workers.engine.step_cost import StepRecord

MIN_RUN_STEPS = 20  # fewer quiet steps: the run's factor is not reported
FIT_ROUNDS = 6  # of fitting the model and the runs' factors in turn


def quiet_steps(records: Iterable[StepRecord]) -> list[StepRecord]:
    """The records that did work, measured their CPU time, and ran with no other engine
    of the node computing."""
    return [r for r in records if has_work(r) and r.cpu_time_s > 0 and r.node_busy == 0]


def speed_factors(runs: Mapping[str, list[StepRecord]]) -> dict:
    """`{factors: {run: factor}, num_steps: {run: n}, spread, slowest, fastest}` of the
    runs with at least `MIN_RUN_STEPS` quiet steps (`quiet_steps`), each factor against
    one model fitted on all of them and relative to the median run; `{}` when fewer than
    two runs qualify."""
    kept = {name: steps for name, steps in runs.items() if len(steps) >= MIN_RUN_STEPS}
    if len(kept) < 2:
        return {}
    rows = {name: np.array([step_features(s).row() for s in steps]) for name, steps in kept.items()}
    cpu = {name: np.array([s.cpu_time_s for s in steps]) for name, steps in kept.items()}
    scale = dict.fromkeys(kept, 1.0)
    for _ in range(FIT_ROUNDS):  # the model on every run's steps with its own scale taken out, then the scales
        model = fit_step_coefficients(np.concatenate(list(rows.values())),
                                      np.concatenate([cpu[name] / scale[name] for name in kept]))
        scale = {name: float(np.median(cpu[name] / np.maximum(MIN_STEP_S, rows[name] @ model))) for name in kept}
    middle = float(np.median(list(scale.values())))
    factors = {name: round(value / middle, 3) for name, value in scale.items()}
    slowest, fastest = max(factors, key=factors.get), min(factors, key=factors.get)
    return {"factors": factors, "num_steps": {name: len(steps) for name, steps in kept.items()},
            "spread": round(factors[slowest] / factors[fastest], 3), "slowest": slowest, "fastest": fastest}


def by_config(factors: Mapping[str, float]) -> dict[str, float]:
    """The median factor of each configuration's runs (named `.../<config>`)."""
    groups: dict[str, list[float]] = {}
    for name, factor in factors.items():
        groups.setdefault(name.rsplit("/", 1)[-1], []).append(factor)
    return {config: round(median(values), 3) for config, values in sorted(groups.items())}


def from_folders(folders: Mapping[str, Path]) -> dict:
    """`speed_factors` of run folders (`{name: folder}`, each with the steps.jsonl a run
    writes with `--save-steps`; one without is left out), with `by_config` beside it."""
    runs = {name: quiet_steps(s.record for s in read_run_records(folder).steps)
            for name, folder in folders.items() if (Path(folder) / STEPS_FILE).is_file()}
    speed = speed_factors(runs)
    if speed:
        speed["by_config"] = by_config(speed["factors"])
    return speed


def describe(speed: Mapping) -> str:
    """One line for the console report."""
    factors = speed["factors"]
    return (f"machine speed (CPU time per unit of work, each run against the median run): "
            f"{speed['fastest']} x{factors[speed['fastest']]:.2f} to {speed['slowest']} "
            f"x{factors[speed['slowest']]:.2f}, a spread of x{speed['spread']:.2f}; the median run of each configuration "
            + ", ".join(f"{config} x{f:.2f}" for config, f in speed["by_config"].items()))
