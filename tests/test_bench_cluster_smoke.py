"""`pdcluster bench cluster --quick --json --save-steps` end to end in its own process
(its own local Ray: one Ray per process, and this one may already run the session's): the
tiny model, one repeat of two workloads in each configuration (`auto` in every SLO
cell), the two scenarios shortened, every run's step records kept, JSON alone on
stdout. The third workload runs through the same loop: `--workloads` picks which."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.bench.cluster import parse_workloads
from cluster.bench.cluster_report import legacy_ratios
from cluster.bench.cluster_runs import CONFIGS
from cluster.bench.sizing import WORKLOAD_NAMES, Baseline, bench_workloads
from cluster.bench.slo_cells import CELLS
from cluster.local.traffic import INTERFERENCE, request_class

WORKLOADS = ("short_low_load", "long_high_load", "mixed")
SMOKE_WORKLOADS = ("short_low_load", "mixed")  # the legacy ratios and both scenarios

REQUIRED_RATIOS = {
    "disagg_itl_p99_vs_colocated", "auto_ttft_p50_vs_colocated_short_low_load",
    "auto_goodput_vs_best_short_low_load", "auto_goodput_vs_best_mixed", "router_overhead_ttft_p50_ms",
}


def test_workload_traces_are_fixed_by_their_seed(tmp_path):
    rows = INTERFERENCE.rows(0)
    assert rows == INTERFERENCE.rows(0) and rows != INTERFERENCE.rows(1)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    longs = [r for r in rows if request_class(r["id"]) == "long"]
    assert [r["timestamp"] for r in longs] == [2.0, 7.0, 12.0, 17.0]
    assert all(r["prompt_len"] == 1536 for r in longs)
    small = INTERFERENCE.scaled(0.5, 0.5, 2.0)
    assert small.num_requests == 17 and small.classes[1].interval_s == 2.5
    trace = INTERFERENCE.write_trace(tmp_path / "t.jsonl")
    assert [json.loads(line) for line in trace.read_text().splitlines()] == rows



def test_bench_workloads_follow_the_baseline():
    fast, slow = bench_workloads(Baseline(50, 1000, 20)), bench_workloads(Baseline(100, 2000, 40))
    assert tuple(fast) == WORKLOADS
    assert fast["long_high_load"].classes[0].rate == 2 * slow["long_high_load"].classes[0].rate
    assert fast["long_high_load"].classes[0].rate == 0.55 * 2 / 1.0  # 110% of one replica
    assert slow["short_low_load"].slo.ttft_ms == 2 * fast["short_low_load"].slo.ttft_ms == 500
    mixed = fast["mixed"]
    assert [c.name for c in mixed.classes] == ["short", "long"]
    assert mixed.slo_of("long").ttft_ms == 5000 and mixed.classes[1].num_requests == 4
    stream_s = (50 + 31 * 20) / 1000  # a 32-token stream alone
    assert abs(mixed.classes[1].interval_s - 40 * stream_s / 2 / 4) < 1e-9


def test_workloads_option_picks_a_subset_in_bench_order():
    assert WORKLOAD_NAMES == WORKLOADS == tuple(bench_workloads(Baseline(50, 1000, 20)))
    assert parse_workloads(None) is None
    assert parse_workloads("long_high_load") == ("long_high_load",)
    assert parse_workloads(" mixed,short_low_load ") == ("short_low_load", "mixed")
    for bad in ("", "long", "mixed,nope"):
        with pytest.raises(ValueError, match="--workloads"):
            parse_workloads(bad)


def test_ratios_only_for_the_workloads_that_ran():
    def cfg(goodput):
        return {"goodput_rps": goodput, "itl_p99_ms": 100.0, "ttft_p50_ms": 1000.0}
    results = {"long_high_load": {"colocated": cfg(0.3), "disagg": cfg(0.5), "auto": cfg(0.49)}}
    assert legacy_ratios(results, None) == {"auto_goodput_vs_best_long_high_load": 0.98}
    ratios = legacy_ratios(results, {"router_overhead_ttft_p50_ms": 4.0})
    assert ratios["router_overhead_ttft_p50_ms"] == 4.0


def test_bench_cluster_quick_prints_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cluster", "bench", "cluster", "--quick", "--json", "--save-steps",
         "--workloads", ",".join(SMOKE_WORKLOADS), "--model-cache", str(tmp_path / "models"),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout carries the JSON alone
    assert REQUIRED_RATIOS <= set(report["ratios"])
    assert tuple(report["results"]) == SMOKE_WORKLOADS
    assert "auto_goodput_vs_best_long_high_load" not in report["ratios"]  # only what ran
    for name, by_config in report["results"].items():
        assert set(by_config) == {c.name for c in CONFIGS}
        for config, figures in by_config.items():
            assert figures["failed"] == 0 and figures["completed"] > 0, (name, config, figures)
        assert by_config["colocated"]["routes"].get("disagg", 0) == 0
        assert by_config["disagg"]["routes"].get("local", 0) == 0
        # colocated really runs on both of its replicas
        cpu = by_config["colocated"]["cpu_s"]
        assert cpu["colocated:DecodeWorker#1"] > 0 and cpu["colocated:DecodeWorker#2"] > 0, cpu
        assert set(report["cells"][name]) == set(CELLS)
        assert {f"auto_goodput_vs_best_{name}_{cell}" for cell in CELLS} <= set(report["targets"])
    hurts, shift = report["scenarios"]["disagg_hurts"], report["scenarios"]["load_shift"]
    assert hurts["delay_s"] > 0 and set(hurts["fault_at_s"]) == {"disagg", "threshold", "auto"}
    assert hurts["num_delayed_layers"]["disagg"] > 0  # the fault really held layers back
    assert all(f["failed"] == 0 for f in hurts["figures"].values()), hurts["figures"]
    assert hurts["long_remote_share"]["num_before"] > 0
    assert set(shift) >= {"first_half", "second_half"}
    for key in ("auto_goodput_vs_best_disagg_hurts", "disagg_hurts_long_remote_share_after_vs_before",
                "auto_goodput_vs_best_load_shift_first_half", "auto_goodput_vs_best_load_shift_second_half",
                "auto_goodput_vs_colocated_mixed_balanced", "auto_goodput_vs_disagg_mixed_balanced"):
        assert key in report["ratios"], key
    assert report["prediction"]["router_side"], report["prediction"]  # the router's own error, per route
    assert any(k.startswith("prediction_ttft_mape_") for k in report["ratios"])
    overhead = report["router_overhead"]
    assert overhead["router_ttft_p50_ms"] > 0 and overhead["direct_ttft_p50_ms"] > 0
    assert isinstance(overhead["router_overhead_paired_p50_ms"], float)
    assert overhead["direct_stream_ttft_p50_ms"] > 0  # the decode replica's stream, called directly
    assert "router_overhead_vs_stream_p50_ms" in report["ratios"]
    assert (tmp_path / "out" / "r0" / "mixed" / "auto" / "steps.jsonl").is_file()  # --save-steps
    short = report["results"]["short_low_load"]
    for config in ("colocated", "disagg", "auto"):  # the router's own log of every run, whatever its mode
        figures = short[config]
        assert figures["num_logged"] == figures["completed"], figures
        assert 0 < figures["worker_ttft_p50_ms"] <= figures["router_ttft_p50_ms"], figures  # the worker's nests inside
        assert (tmp_path / "out" / "r0" / "short_low_load" / config / "decisions.json").is_file()
    assert report["ratios"]["auto_router_ttft_p50_vs_colocated_short_low_load"] > 0
    speed = report["machine_speed"]  # each run's speed from its steps' CPU time
    assert len(speed["factors"]) >= 2 and set(speed["by_config"]) <= {c.name for c in CONFIGS}, speed
    assert all(name.split("/")[1] in SMOKE_WORKLOADS for name in speed["factors"]) and speed["spread"] >= 1.0
    assert report["run_time_s"] > 0 and report["machine"]["cores"] >= 1
    assert report["setup"]["workload_path"] == "direct ingress"  # straight to the router replicas
