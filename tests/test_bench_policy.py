"""`pdcluster bench policy` with a few replicas and decisions: the JSON report has the
documented shape and both routes were taken. No timing assertion: the figures are the
benchmark's, and this machine may be busy."""

from __future__ import annotations

import gc
import json

from typer.testing import CliRunner

from cluster.bench.policy import MODES, PolicyBenchConfig, run_benchmark
from cluster.cli import app

FIGURES = {"num_decisions", "p50_ms", "p99_ms", "max_ms", "mean_ms", "decisions_per_s", "cpu_p50_ms", "cpu_p99_ms",
           "routes", "kinds", "reasons", "prefix_hit_fraction", "num_heartbeats", "heartbeat_update_p50_ms",
           "heartbeat_update_max_ms", "machine_probe_p50_ms", "machine_probe_p99_over_p50"}


def test_bench_policy_reports_both_modes_and_both_routes():
    cfg = PolicyBenchConfig(num_replicas=8, num_decisions=300, num_warmup=50, seed=1)
    report = run_benchmark(cfg)
    assert report["bench"] == "policy" and list(report["results"]) == list(MODES)
    for mode, r in report["results"].items():
        assert set(r) == FIGURES, mode
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] and r["decisions_per_s"] > 0
        assert r["num_decisions"] == 300 == sum(r["routes"].values()) == sum(r["kinds"].values())
        assert r["routes"].get("local", 0) > 0 and r["routes"].get("disagg", 0) > 0, (mode, r["routes"])
        assert 0 < r["prefix_hit_fraction"] < 1  # shared prefixes hit, fresh prompts do not
        assert r["num_heartbeats"] > 0 and 0 < r["heartbeat_update_p50_ms"] <= r["heartbeat_update_max_ms"]
        assert r["machine_probe_p50_ms"] > 0 and r["machine_probe_p99_over_p50"] >= 1.0
    assert set(report["results"]["auto"]["kinds"]) <= {"remote", "local", "background", "whole"}
    target = report["targets"]["auto_place_p99_ms"]
    assert set(target) == {"value", "limit", "met"} and target["value"] == report["results"]["auto"]["p99_ms"]
    assert report["setup"]["num_prefill"] == 4 and report["setup"]["num_decode"] == 4
    assert report["machine"]["cores"] >= 1 and len(report["machine"]["loadavg_start"]) == 3
    # measured under the router's collector setting, which is undone afterwards
    assert report["setup"]["gc_thresholds"][0] == report["setup"]["gc_gen0_threshold"] == 5000
    assert gc.get_threshold()[0] != 5000 and gc.get_freeze_count() == 0


def test_bench_policy_cli_prints_json_alone_on_stdout():
    args = ["bench", "policy", "--json", "--replicas", "5", "--prefill-replicas", "2", "--decisions", "40",
            "--warmup", "5", "--seed", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["bench"] == "policy" and report["setup"]["num_decode"] == 3
    assert report["results"]["threshold"]["num_decisions"] == 40
    default = CliRunner().invoke(app, [*args, "--gc-gen0-threshold", "0"])
    assert json.loads(default.stdout)["setup"]["gc_thresholds"] == list(gc.get_threshold())
