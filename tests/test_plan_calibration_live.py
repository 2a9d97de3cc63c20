"""Calibration against a real deployment: real Ray Serve, real workers, real HTTP. A load
test with `save_steps` writes the deployment's records beside its requests; the run
folder and the live admin API each make a calibration named from the deployment's own
report; a wrong token or an unreachable URL says what to do."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from typer.testing import CliRunner

from tests.serve_support import wait_ok

APP = "pdc-plan-calibration"
TOKEN = "plan-calibration-admin-token"


@pytest.fixture(scope="module")
def url(ray_cluster, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from cluster.app import build_app

    token_file = tmp_path_factory.mktemp("secrets") / "admin"
    token_file.write_text(TOKEN)
    config = {
        "model": {"path": str(tiny_model_dir)},
        "engine": {"num_kv_blocks": 640, "max_num_seqs": 12},
        "transport": {"host": "127.0.0.1"},
        "router": {"num_cpus": 0},
        "secrets": {"admin_token_file": str(token_file)},
        "workloads": {"default": {"mode": "threshold", "min_remote_prefill_tokens": 96}},
    }
    serve.run(build_app(config), name=APP, route_prefix="/plan-calibration")
    base = f"http://127.0.0.1:{ray_cluster['http_port']}/plan-calibration"
    wait_ok(base)
    yield base
    serve.delete(APP)


def test_a_load_test_saves_the_records_and_they_calibrate(url, tmp_path):
    from cluster.loadtest.api import run_loadtest
    from cluster.loadtest.config import LoadTestConfig
    from cluster.plan.calibrate import from_runs
    from cluster.plan.records import read_run_records

    out = tmp_path / "run"
    started = time.time()
    run_loadtest(LoadTestConfig(url=url, out_dir=out, workload="chat-short", num_requests=16, concurrency=2,
                                plots=False, save_steps=True, admin_token=TOKEN))
    records = read_run_records(out)
    roles = {s.replica_id: s.role for s in records.steps}
    assert sorted(roles.values()) == ["decode", "prefill"]  # one replica of each, ids kept
    assert all(s.record.start_time >= started - 2 for s in records.steps)
    assert records.transfers and {t.role for t in records.transfers} == {"prefill"}
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sum(r["route"] == "disagg" for r in requests) == len(records.transfers)  # the probes are short: local
    deployment = json.loads((out / "deployment.json").read_text())
    assert deployment["collection"]["num_gaps"] == 0 and deployment["collection"]["last_error"] is None

    c = from_runs([out])
    assert (c.source, c.model, c.device, c.dtype) == ("run", "tiny", "cpu", "float32")
    assert (c.limits.num_kv_blocks, c.limits.max_num_seqs, c.limits.num_layers) == (640, 12, 2)
    assert c.limits.kv_bytes_per_token == 512 and "assumed" not in c.notes
    assert c.transfer.num_samples == len(records.transfers) and c.transfer.path != "none"
    assert c.quality.num_held_out > 0 and c.step.num_samples == c.quality.num_fitted
    assert c.request_overhead_s >= 0  # concurrency 2: few requests ran alone; the notes say which way


def test_the_live_source_and_its_errors(url, tmp_path, monkeypatch):
    from cluster.cli import app
    from cluster.plan.calibrate import from_live
    from cluster.plan.live import AdminError, StepsCollector, fetch_records

    for _ in range(4):
        httpx.post(url + "/v1/completions", json={"prompt": "live records " * 8, "max_tokens": 6}, timeout=60)
    # polled through traffic: each record kept once however many polls saw it
    with StepsCollector(url, TOKEN, poll_s=0.1) as collector:
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json={"prompt": "polled " * 8, "max_tokens": 8,
                                                         "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
        time.sleep(0.35)  # a few polls whatever the requests took
    assert collector.num_polls >= 3 and collector.last_error is None, (collector.num_polls, collector.last_error)
    kept = [(s.replica_id, s.record) for s in collector.records.steps]
    assert len(kept) == len(set(kept)) and sum(s.record.num_decode_seqs for s in collector.records.steps) >= 3 * 7
    c = from_live(url, TOKEN)
    assert (c.source, c.model, c.device) == ("live", "tiny", "cpu") and c.quality.num_held_out > 0
    with pytest.raises(AdminError, match="refused"):
        fetch_records(url, "wrong-token")
    with pytest.raises(AdminError, match="unreachable"):
        fetch_records("http://127.0.0.1:9", TOKEN)
    runner = CliRunner()
    monkeypatch.setenv("PDC_ADMIN_TOKEN", "wrong-token")
    result = runner.invoke(app, ["plan", "calibrate", "--url", url])
    assert result.exit_code == 2 and "PDC_ADMIN_TOKEN" in result.output
    monkeypatch.setenv("PDC_ADMIN_TOKEN", TOKEN)
    result = runner.invoke(app, ["plan", "calibrate", "--url", url, "--out", str(tmp_path / "c.json"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["source"] == "live"


def test_a_real_open_loop_run_replays_from_the_command_line(url, tmp_path):
    from cluster.cli import app
    from cluster.loadtest.api import run_loadtest
    from cluster.loadtest.config import SLO, LoadTestConfig

    out = tmp_path / "run"
    summary = run_loadtest(LoadTestConfig(url=url, out_dir=out, workload="chat-short", rate=8.0, num_requests=24,
                                          seed=5, slo=SLO(ttft_ms=2000, tpot_ms=200), plots=False,
                                          save_steps=True, admin_token=TOKEN))
    deployment = json.loads((out / "deployment.json").read_text())
    assert deployment["workloads"]["default"]["mode"] == "threshold"  # what the router routed by
    assert deployment["replicas"] and all(r["num_layers"] == 2 for r in deployment["replicas"].values())
    result = CliRunner().invoke(app, ["plan", "validate", str(out), "--json", "--out", str(tmp_path / "v")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "v" / "validation.json").read_text()) == data
    [row] = data["runs"]
    assert (row["deployment"], row["rate"], row["num_requests"]) == ("1P+1D", 8.0, 24)
    figures = row["figures"]
    assert figures["ttft_p50_ms"]["measured"] == summary.ttft_ms["p50"]
    assert all(figures[k]["predicted"] is not None and figures[k]["predicted"] > 0
               for k in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "tpot_p50_ms", "throughput_rps"))
    assert sum(row["routes"]["predicted"].values()) == 24
    assert data["calibrations"]["1P+1D"]["source"] == "run"
    # the same folder, printed as a table
    table = CliRunner().invoke(app, ["plan", "validate", str(out), "--calibration", _calibration(out, tmp_path)])
    assert table.exit_code == 0 and "ttft_p50_ms" in table.output


def _calibration(run, tmp_path) -> str:
    from cluster.plan.calibrate import from_runs

    return str(from_runs([run]).save(tmp_path / "calibration.json"))
