"""The machine's speed per bench run, read from the engines' step records
(cluster/bench/machine_speed.py): the same work taking more CPU time in one run shows as
that run's factor, whatever mix of steps each run had."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from cluster.bench.cluster_runs import CONFIGS, run_folders
from cluster.bench.machine_speed import (
    MIN_RUN_STEPS,
    by_config,
    describe,
    from_folders,
    quiet_steps,
    speed_factors,
)
from workers.engine.step_cost import StepRecord

FIXED_S, TOKEN_S, SEQ_S = 0.012, 5e-4, 2e-3


def _steps(n: int, slower: float, seed: int, decode_only: bool = False) -> list[StepRecord]:
    """`n` steps of a random mix, their CPU time the reference cost times `slower`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = 0 if decode_only or rng.random() < 0.5 else rng.randint(16, 512)
        seqs = rng.randint(1, 8)
        cpu = (FIXED_S + TOKEN_S * tokens + SEQ_S * seqs) * slower * rng.uniform(0.97, 1.03)
        out.append(StepRecord(0.0, cpu * 1.3, tokens, seqs, 100 * seqs + tokens, seqs, 0,
                              num_prefill_seqs=1 if tokens else 0, cpu_time_s=cpu))
    return out


def test_a_run_on_a_slower_machine_shows_its_factor_whatever_its_step_mix():
    runs = {"r0/mixed/colocated": _steps(80, 1.0, 1), "r0/mixed/auto": _steps(80, 1.3, 2, decode_only=True),
            "r1/mixed/colocated": _steps(80, 1.0, 3)}
    speed = speed_factors(runs)
    factors = speed["factors"]
    assert factors["r0/mixed/auto"] / factors["r0/mixed/colocated"] == pytest.approx(1.3, rel=0.05)
    assert factors["r1/mixed/colocated"] == pytest.approx(factors["r0/mixed/colocated"], rel=0.05)
    assert speed["slowest"] == "r0/mixed/auto" and speed["spread"] == pytest.approx(1.3, rel=0.05)
    assert by_config(factors) == {"auto": factors["r0/mixed/auto"],
                                  "colocated": pytest.approx(factors["r0/mixed/colocated"], rel=0.05)}


def test_steps_beside_a_busy_neighbour_or_without_cpu_time_do_not_count():
    steps = _steps(30, 1.0, 4)
    steps[0] = dataclasses.replace(steps[0], node_busy=1.0)  # contention the routes cause
    steps[1] = dataclasses.replace(steps[1], cpu_time_s=0.0)  # not measured
    steps[2] = dataclasses.replace(steps[2], num_prefill_tokens=0, num_decode_seqs=0)  # an idle step
    assert quiet_steps(steps) == steps[3:]


def test_too_few_steps_leave_a_run_out_and_one_run_gives_no_figure():
    assert speed_factors({"a": _steps(MIN_RUN_STEPS - 1, 1.0, 5), "b": _steps(40, 1.0, 6)}) == {}
    assert speed_factors({}) == {}


def test_run_folders_read_back_with_their_names(tmp_path):
    folders = run_folders(tmp_path, ["mixed"], 2)
    assert len(folders) == 2 * len(CONFIGS) and "r1/mixed/threshold" in folders
    for i, (name, folder) in enumerate(sorted(folders.items())[:3]):
        folder.mkdir(parents=True)
        slower = 1.25 if name.endswith("auto") else 1.0
        lines = [json.dumps({"replica_id": "d1", "role": "decode", **dataclasses.asdict(s)})
                 for s in _steps(50, slower, i)]
        (folder / "steps.jsonl").write_text("\n".join(lines) + "\n")
    speed = from_folders(folders)  # folders without records are left out
    assert len(speed["factors"]) == 3 and set(speed["by_config"]) <= {c.name for c in CONFIGS}
    line = describe(speed)
    assert speed["slowest"] in line and f"x{speed['spread']:.2f}" in line
