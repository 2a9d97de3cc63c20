"""`plan validate` on run folders whose truth is known: a run the simulator itself made
replays to the same figures (same arrivals, same cluster, same routing: every error 0);
a saturation search it made is found again inside the measured bracket; rankings
count ties as agreeing; folders that cannot be replayed say why."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cluster.cli import app
from cluster.config import WorkloadProfile
from cluster.loadtest.config import SLO
from cluster.loadtest.report import write_report
from cluster.plan.calibration import StepModel
from cluster.plan.evaluate import ATTAINMENT, AttainmentPoint
from cluster.plan.records import DEPLOYMENT_FILE
from cluster.plan.replay import ReplayError, read_run
from cluster.plan.saturation import saturation_rate
from cluster.plan.sim.arrivals import at_rate
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.simulator import Simulation, simulate
from cluster.plan.validate import orders_agree, relative_error, validate, write_search
from tests.test_plan_search import CALIBRATION
from workers.engine.cost_model import StepCoefficients

SLO_ = SLO(ttft_ms=400.0, tpot_ms=60.0)


def _deployment(folder, num_prefill: int, num_decode: int, mode: str) -> None:
    replicas = {f"p{i}": {"role": "prefill"} for i in range(num_prefill)}
    replicas |= {f"d{i}": {"role": "decode"} for i in range(num_decode)}
    workloads = {"default": WorkloadProfile(mode=mode).model_dump()}
    (folder / DEPLOYMENT_FILE).write_text(json.dumps({"replicas": replicas, "workloads": workloads}))


def _simulated_run(folder, rate: float, seed: int, num_requests: int = 60, num_prefill: int = 1,
                   forced: str | None = "disagg"):
    """A run folder as `loadtest --rate --save-steps` writes it, the simulator standing in
    for the deployment (its profile: threshold; the load test sends `x-pd-mode: forced`)."""
    config = SimConfig(num_prefill=num_prefill, num_decode=1, replicas_per_node=1 + num_prefill,
                       profiles={"default": WorkloadProfile(mode="threshold")}, forced_mode=forced, seed=seed)
    result = simulate(config, CALIBRATION, at_rate("chat-short", rate, num_requests, seed), target_rate=rate)
    env = {"workload": "chat-short", "seed": seed, "load": {"kind": "open", "rate": rate, "burstiness": 1.0},
           "num_requests": num_requests, "duration_limit_s": None, "mode": forced}
    write_report(folder, result.summary(SLO_, env), result.records, plots=False)
    _deployment(folder, num_prefill, 1, "threshold")
    return result


def test_a_run_the_simulator_made_replays_to_its_own_figures(tmp_path):
    made = _simulated_run(tmp_path, rate=6.0, seed=3)
    run = read_run(tmp_path)
    assert (run.deployment.name, run.mode, run.target_rate) == ("1P+1D", "disagg", 6.0)
    assert [a.spec.request_id for a in run.arrivals()] == [r.request_id for r in made.records]
    data = validate([tmp_path], CALIBRATION)
    [row] = data["runs"]
    assert row["routes"]["predicted"] == row["routes"]["measured"] == {"disagg": 60, "local": 0}
    for name, figure in row["figures"].items():
        assert figure["measured"] is not None and figure["error"] == 0.0, (name, figure)


def test_the_replay_follows_the_recorded_mode_and_cluster(tmp_path):
    forced, profile = tmp_path / "forced", tmp_path / "profile"
    _simulated_run(forced, rate=6.0, seed=4, forced="local")
    _simulated_run(profile, rate=6.0, seed=4, forced=None, num_prefill=2)
    rows = {r["run"]: r for r in validate([forced, profile], CALIBRATION)["runs"]}
    assert rows[str(forced)]["routes"]["predicted"] == {"local": 60, "disagg": 0}
    assert rows[str(profile)]["deployment"] == "2P+1D"
    assert all(f["error"] == 0.0 for f in rows[str(profile)]["figures"].values())


def test_a_search_is_found_again_inside_its_bracket(tmp_path):
    points = []

    def measure(_option, rate: float):
        folder = tmp_path / f"rate-{rate:.4g}"
        result = _simulated_run(folder, rate, seed=11)
        points.append({"rate": rate, "attainment": result.summary(SLO_).goodput["fraction"], "run": folder.name})
        return AttainmentPoint(rate, points[-1]["attainment"])

    found = saturation_rate(measure, None, 4.0, factor=1.5, rel_tol=0.3)
    assert found.rate is not None and found.high is not None
    write_search(tmp_path, {"workload": "chat-short", "num_requests": 60, "seed": 11, "slo": SLO_.as_dict(),
                            "start_rate": 4.0, "factor": 1.5, "rel_tol": 0.3, "rate": found.rate,
                            "high": found.high, "points": [p | {"meets": p["attainment"] >= ATTAINMENT}
                                                           for p in points]})
    data = validate([tmp_path], CALIBRATION)
    [search] = data["searches"]
    predicted = search["predicted"]["rate"]
    assert found.rate <= predicted < found.high, (found, predicted)
    assert abs(search["error"]) <= (found.high / found.rate) ** 0.5 - 1 + 1e-6
    assert len(data["runs"]) == len(points)  # every run of the search is replayed too


def test_simulated_replicas_report_the_fit_a_real_replica_would():
    reported = StepModel.of(StepCoefficients(0.001, 1e-5, 0.0, 5e-4, 0.0))
    calibration = CALIBRATION.model_copy(update={"reported_step": reported})
    engine = next(iter(Simulation(SimConfig(num_prefill=0, num_decode=1), calibration).engines.values()))
    assert engine.stats()["step_model"] == reported.coefficients().to_dict()  # what the router sees
    assert engine.coefficients == CALIBRATION.step.coefficients()  # what its steps cost


def test_rankings_agree_unless_an_order_is_reversed_beyond_a_tie():
    assert orders_agree({"a": 10.0, "b": 5.0}, {"a": 8.0, "b": 4.0})
    assert not orders_agree({"a": 10.0, "b": 5.0}, {"a": 4.0, "b": 8.0})
    assert orders_agree({"a": 10.0, "b": 9.7}, {"a": 4.0, "b": 8.0})  # measured within 5%: a tie
    assert orders_agree({"a": 10.0, "b": 5.0}, {"a": 7.9, "b": 8.0})  # predicted a tie
    assert relative_error(11.0, 10.0) == 0.1 and relative_error(1.0, None) is None and relative_error(1.0, 0) is None


def test_folders_that_cannot_be_replayed_say_why(tmp_path):
    with pytest.raises(ReplayError, match="summary.json"):
        read_run(tmp_path)
    _simulated_run(tmp_path, rate=6.0, seed=5)
    summary = json.loads((tmp_path / "summary.json").read_text())
    summary["env"]["load"] = {"kind": "closed", "concurrency": 4}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ReplayError, match="--rate, --ramp or --trace"):
        read_run(tmp_path)
    result = CliRunner().invoke(app, ["plan", "validate", str(tmp_path)])
    assert result.exit_code == 2 and "cannot be replayed" in result.output
