"""`pdcluster loadtest` / `compare` end to end (typer runner, real fake server), the sweep,
and `--clients 2` over Ray actors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cluster.cli import app
from cluster.loadtest.api import run_loadtest
from cluster.loadtest.config import SLO, LoadTestConfig
from cluster.loadtest.report import read_records
from tests.fake_openai_server import FakeServer


@pytest.fixture(scope="module")
def server():
    with FakeServer(ttft_ms=20, tpot_ms=5, disagg_min_prompt=150) as s:
        yield s


def test_loadtest_and_compare_commands(server, tmp_path):
    runner = CliRunner()
    runs = []
    for mode in ("local", "disagg"):
        out = tmp_path / mode
        result = runner.invoke(app, ["loadtest", "--url", server.url, "--out", str(out), "--rate", "40",
                                     "--num-requests", "20", "--mode", mode, "--slo", "ttft_ms=2000,e2e_ms=10000",
                                     "--header", "x-test:1", "--seed", "5"])
        assert result.exit_code == 0, result.output
        assert "ttft_ms" in result.output and "goodput" in result.output
        summary = json.loads((out / "summary.json").read_text())
        assert summary["routes"][mode] == 20 and summary["goodput"]["fraction"] == 1.0
        assert (out / "latency_cdf.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
        runs.append(str(out))
    cmp_out = tmp_path / "cmp"
    result = runner.invoke(app, ["compare", *runs, "--out", str(cmp_out)])
    assert result.exit_code == 0, result.output
    assert "ratios against the first run" in result.output and "×" in result.output
    data = json.loads((cmp_out / "compare.json").read_text())
    assert data["runs"] == ["local", "disagg"]
    rows = {r["metric"]: r for r in data["rows"]}
    assert rows["completed"]["ratios"] == [1.0, 1.0] and rows["routes local"]["values"] == [20, 0]
    for png in ("latency_cdf.png", "metrics.png"):
        assert (cmp_out / png).stat().st_size > 0
    assert (cmp_out / "compare.csv").exists()


def test_bad_options_give_a_clear_error(server, tmp_path):
    result = CliRunner().invoke(app, ["loadtest", "--url", server.url, "--out", str(tmp_path),
                                      "--rate", "5", "--concurrency", "2"])
    assert result.exit_code == 2 and "one load shape" in result.output
    result = CliRunner().invoke(app, ["loadtest", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "cannot reach" in result.output
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "nothing"), "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "summary.json" in result.output


def test_sweep_reports_saturation_and_the_slo_rate(server, tmp_path):
    config = LoadTestConfig(url=server.url, out_dir=tmp_path / "sweep", sweep=True, num_requests=16, sweep_points=2,
                            sweep_max_concurrency=8, slo=SLO(e2e_ms=60000), workload="chat-short")
    summary = run_loadtest(config)
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    rates = [p["rate"] for p in sweep["points"]]
    assert sweep["saturation_rps"] > 0 and len(rates) == 3 and rates == sorted(rates)
    assert sweep["max_rate_meeting_slo"] == max(rates)  # a generous SLO: every rate meets it
    assert summary.env["sweep"]["saturation_rps"] == sweep["saturation_rps"]
    assert (tmp_path / "sweep" / "sweep_vs_rate.png").stat().st_size > 0
    strict = run_loadtest(LoadTestConfig(url=server.url, sweep=True, num_requests=4, sweep_points=2,
                                         sweep_max_concurrency=4, slo=SLO(ttft_ms=1)))
    assert strict.env["sweep"]["max_rate_meeting_slo"] is None


def test_trace_and_ramp_replay(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 + 0.05 * i, "prompt_len": 30 + i, "output_len": 4}) + "\n"
                             for i in range(10)))
    s = run_loadtest(LoadTestConfig(url=server.url, out_dir=tmp_path / "t", trace=trace, plots=False))
    records = read_records(tmp_path / "t")
    assert s.requests["completed"] == 10 and [r.target_prompt_len for r in records] == list(range(30, 40))
    assert all(abs(r.sent_at_s - 0.05 * r.index) < 0.05 for r in records)
    ramp = run_loadtest(LoadTestConfig(url=server.url, ramp=(5.0, 60.0), duration_s=1.5, plots=False))
    assert ramp.requests["completed"] > 10 and ramp.rate["target"] is None


def test_two_ray_clients_merge_into_one_run(server, tmp_path, ray_session):
    config = LoadTestConfig(url=server.url, out_dir=tmp_path / "k2", rate=40.0, num_requests=40, clients=2,
                            plots=False, slo=SLO(ttft_ms=5000))
    summary = run_loadtest(config)
    records = read_records(config.out_dir)
    assert summary.requests == {"completed": 40, "failed": 0} and summary.goodput["fraction"] == 1.0
    assert [r.index for r in records] == list(range(40))
    assert {r.client_id for r in records} == {0, 1}
    assert all(r.client_id == r.index % 2 for r in records)
    lags = [r.sent_at_s - r.scheduled_at_s for r in records]
    loop_lag_p90_s = summary.env["client_loop_lag_ms"]["p90"] / 1000
    assert min(lags) > -0.01 and sorted(lags)[len(lags) // 2] < 0.05 + loop_lag_p90_s  # one shared time 0
    planned_span = records[-1].scheduled_at_s - records[0].scheduled_at_s
    assert abs(39 / summary.rate["achieved"] - planned_span) <= max(lags) - min(lags) + 1e-3
    closed = run_loadtest(LoadTestConfig(url=server.url, concurrency=4, num_requests=12, clients=2, plots=False))
    assert closed.requests["completed"] == 12
