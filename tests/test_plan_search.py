"""The planner's search over simulated configurations: the options it weighs, the
saturation-rate search, prompt scaling for sensitivity, and a whole plan on a small
cluster whose outputs (ranking, recommendation or replica count, config, plots) hold
together."""

from __future__ import annotations

import json

import pytest

from cluster.config import load_config
from cluster.plan.calibration import Calibration, EngineLimits, FitQuality, StepModel, TransferModel
from cluster.plan.command import PlanArgs, plan
from cluster.plan.evaluate import ATTAINMENT, PlanPoint, Workload, load_slo, scale_prompts
from cluster.plan.options import PlanOption, plan_options, prefill_sizes
from cluster.plan.saturation import REL_TOL, saturation_rate
from cluster.plan.search import HEADROOM
from cluster.plan.sim.arrivals import at_rate
from workers.engine.cost_model import StepCoefficients
from workers.engine.transfer_cost import TransferCoefficients

# the tiny model's step costs on a 2-core CPU, as a live deployment fitted them
CALIBRATION = Calibration(
    model="tiny-seed0", engine_version="test", device="cpu", dtype="float32", source="run", created_at=0.0,
    limits=EngineLimits(block_size=16, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=1024,
                        kv_bytes_per_token=4096, num_layers=8),
    step=StepModel.of(StepCoefficients(0.012, 0.00058, 3.4e-7, 0.0019, 6.7e-6)),
    transfer=TransferModel.of(TransferCoefficients(0.003, 5e8)),
    quality=FitQuality(median_relative_error=0.05, p90_relative_error=0.1, num_fitted=100, num_held_out=20),
    request_overhead_s=0.005)


def test_options_cover_every_split_and_mode_and_thin_out_for_large_clusters():
    options = plan_options(4)
    assert options[0] == PlanOption(0, 4, "local")
    assert {o.num_prefill for o in options[1:]} == {1, 2, 3}
    assert {o.mode for o in options} == {"local", "auto", "disagg", "threshold"}
    assert len({o.name for o in options}) == len(options)
    sizes = prefill_sizes(128)
    assert 10 <= len(sizes) <= 12 and sizes[0] == 1 and sizes[-1] <= 127
    assert PlanOption(2, 6, "auto").scaled_to(16) == PlanOption(4, 12, "auto")
    assert PlanOption(0, 4, "local").scaled_to(6) == PlanOption(0, 6, "local")


def _point(option: PlanOption, rate: float, attainment: float) -> PlanPoint:
    return PlanPoint(option, rate, attainment, rate * attainment, rate, {}, {}, {}, {}, {}, {}, 0.0)


@pytest.mark.parametrize("capacity", [0.3, 2.0, 7.3, 50.0])
def test_saturation_is_the_highest_rate_that_meets_within_tolerance(capacity):
    option = PlanOption(0, 1, "local")
    calls = []

    def evaluate(o, rate):  # a cluster that meets its SLO up to `capacity` req/s
        calls.append(rate)
        return _point(o, rate, 1.0 if rate <= capacity else 0.5)

    found = saturation_rate(evaluate, option, start_rate=2.0)
    assert capacity / (1 + REL_TOL) <= found.rate <= capacity
    assert [p.rate for p in found.points] == sorted(set(calls)) and len(calls) <= 16


def test_saturation_when_it_never_meets_or_always_does():
    option = PlanOption(0, 1, "local")
    never = saturation_rate(lambda o, r: _point(o, r, 0.0), option, 1.0)
    assert never.rate is None
    always = saturation_rate(lambda o, r: _point(o, r, 1.0), option, 1.0)
    assert always.capped and always.rate >= 128.0


def test_scaled_prompts_keep_shared_text_shared():
    arrivals = at_rate("shared-prefix", 2.0, 20, seed=1)
    longer = scale_prompts(arrivals, 1.2)
    for a, b in zip(arrivals, longer, strict=True):
        assert b.at_s == a.at_s and b.spec.output_len == a.spec.output_len
        for m, n in zip(a.spec.messages, b.spec.messages, strict=True):
            assert len(n["content"]) == round(1.2 * len(m["content"]))
    prefixes = {a.spec.messages[0]["content"] for a in longer}
    assert len(prefixes) < len(longer)  # the system prompt is still shared


def test_a_whole_plan_holds_together(tmp_path):
    args = PlanArgs(Workload("chat-short", 150, seed=2), rate=2.0, slo=load_slo("ttft_ms=1500,tpot_ms=120"),
                    num_replicas=3, out=tmp_path, as_json=True)
    data = plan(args, CALIBRATION)
    configs = data["configurations"]
    assert len(configs) == len(plan_options(3))
    assert [c["goodput_per_replica"] for c in configs] == sorted((c["goodput_per_replica"] for c in configs),
                                                                   reverse=True)
    assert all(c["meets_slo"] == (c["slo_attainment"] >= ATTAINMENT) for c in configs)
    rec = data["recommendation"]
    if rec is not None:
        assert rec["meets_slo"] and rec["rate_vs_saturation"] <= HEADROOM
    else:
        assert data["no_recommendation_because"] and data["replicas_needed"] is not None
    assert set(data["sensitivity"]) == {"rate_x0.8", "rate_x1.2", "prompt_len_x0.8", "prompt_len_x1.2"}
    assert data["disaggregation"]["sentence"].startswith("Disaggregation")
    files = data["files"]
    config = load_config(files["config"])  # what `pdcluster serve --config` reads
    chosen = rec or configs[0]
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (chosen["num_prefill"], chosen["num_decode"])
    assert config.workloads["default"].mode == chosen["mode"]
    assert config.router.default_slo.ttft_ms == 1500
    assert (config.model.preset, config.model.path) == ("tiny", None)  # the calibration's embedded model
    for key in ("split_plot", "rate_plot"):
        assert open(files[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.loads(open(files["report"]).read())["rate"] == 2.0


def test_the_plan_command_line(tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    path = CALIBRATION.save(tmp_path / "calibration.json")
    args = ["plan", "--workload", "chat-short", "--rate", "1.5", "--slo", "ttft_ms=1500,tpot_ms=120",
            "--replicas", "2", "--num-requests", "60", "--calibration", str(path)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["calibration"]["path"] == str(path) and len(data["configurations"]) == len(plan_options(2))
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "ranked by goodput per replica" in table.stdout
    assert "Disaggregation" in table.stdout
    partial = CliRunner().invoke(app, ["plan", "--workload", "chat-short", "--rate", "1"])
    assert partial.exit_code == 2 and "--slo" in partial.output
    bad = CliRunner().invoke(app, [*args[:-2], "--slo", "ttft_ms=100"])
    assert bad.exit_code == 2 and "tpot_ms" in bad.output
