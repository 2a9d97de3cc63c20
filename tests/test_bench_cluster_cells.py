"""The pure parts of `pdcluster bench cluster`'s comparisons, on synthetic request
records (no Ray, no server): SLO cells and their re-scoring, pooling over repeats, the
`met: null` rule, the ratio names, the scenarios' sizing, the remote share around the
fault, the load shift's halves and the pooled prediction error."""

from __future__ import annotations

import json

import pytest

from cluster.bench.cluster_report import build_report, pool_errors, weighted_median
from cluster.bench.cluster_runs import CONFIGS, RunResult
from cluster.bench.cluster_scenarios import (
    FAULT_TAIL_X,
    WINDOW_S,
    disagg_hurts,
    fault_at_s,
    fault_delay_s,
    halves,
    load_shift,
    remote_shift,
    scenario_targets,
    score_disagg_hurts,
    score_load_shift,
    shift_at_s,
)
from cluster.bench.route_split import describe
from cluster.bench.sizing import Baseline, bench_workloads
from cluster.bench.slo_cells import CELLS, cell_slos, compare, num_good, score_cells
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.runner import build_plan
from cluster.local.traffic import request_class

B = Baseline(ttft_short_ms=100.0, ttft_long_ms=1000.0, tpot_ms=20.0)
N_TOKENS = 11


def rec(rid: str, ttft_ms: float, tpot_ms: float, *, at_s: float = 0.0, route: str | None = "local",
        ok: bool = True, index: int = 0) -> RequestRecord:
    """One finished request of N_TOKENS tokens: TTFT, then TPOT per later token."""
    ttft, tpot = ttft_ms / 1000.0, tpot_ms / 1000.0
    r = RequestRecord(index, rid, "bench_" + request_class(rid), at_s, sent_at_s=at_s, ttft_s=ttft,
                      e2e_s=ttft + (N_TOKENS - 1) * tpot, completion_tokens=N_TOKENS, route=route)
    if not ok:
        r.error_kind = "http_500"
    return r


def test_cells_are_multiples_of_the_unloaded_latencies():
    assert set(CELLS) == {"tight", "balanced", "loose", "tight_ttft", "tight_tpot"}
    slos = {cell: cell_slos(B, cell, ["short", "long"]) for cell in CELLS}
    assert slos["tight"]["short"].as_dict() == {"ttft_ms": 200.0, "tpot_ms": 40.0}
    assert slos["balanced"]["long"].as_dict() == {"ttft_ms": 5000.0, "tpot_ms": 100.0}
    assert slos["loose"]["long"].as_dict() == {"ttft_ms": 10000.0, "tpot_ms": 200.0}
    assert slos["tight_ttft"]["short"].as_dict() == {"ttft_ms": 200.0, "tpot_ms": 200.0}
    assert slos["tight_tpot"]["long"].as_dict() == {"ttft_ms": 10000.0, "tpot_ms": 40.0}
    # the balanced cell is what the workloads have always been scored against
    mixed = bench_workloads(B)["mixed"]
    assert {c.name: c.slo for c in mixed.classes} == slos["balanced"]


def test_a_request_is_good_against_its_own_class_slo():
    records = [rec("short-0", 150, 30), rec("short-1", 300, 30), rec("long-0", 3000, 30),
               rec("long-1", 1500, 30), rec("short-2", 150, 30, ok=False)]
    good = {cell: num_good(records, cell_slos(B, cell, ["short", "long"])) for cell in CELLS}
    # tight (200/2000 ms TTFT, 40 ms TPOT): short-0 and long-1; tight_ttft the same; the
    # failed request is good nowhere
    assert good == {"tight": 2, "balanced": 4, "loose": 4, "tight_ttft": 2, "tight_tpot": 4}


def run_of(records_per_config: dict[str, list[RequestRecord]]) -> dict[str, list[list[RequestRecord]]]:
    return {config: [rs] for config, rs in records_per_config.items()}


def test_fixed_runs_are_rescored_in_every_cell_and_auto_runs_only_in_their_own():
    fast_shorts = [rec(f"short-{i}", 150, 30) for i in range(6)]  # good in every cell
    slow_shorts = [rec(f"short-{i}", 400, 30) for i in range(6)]  # good from balanced (500) up
    runs = {"colocated": [fast_shorts], "disagg": [slow_shorts], "threshold": [slow_shorts[:3]],
            "auto": [slow_shorts], "auto_tight": [fast_shorts[:5]]}
    cells = score_cells(B, ["short"], runs)
    assert set(cells) == {"tight", "balanced"}  # only cells whose auto ran
    tight, balanced = cells["tight"], cells["balanced"]
    assert tight["good"] == {"colocated": 6, "disagg": 0, "threshold": 0, "auto": 5}
    assert tight["best"] == "colocated" and tight["met"] is True  # 5 >= 6 - 1
    assert tight["sent"]["auto"] == 5 and tight["slo"]["short"] == {"ttft_ms": 200.0, "tpot_ms": 40.0}
    assert balanced["good"] == {"colocated": 6, "disagg": 6, "threshold": 3, "auto": 6}
    assert balanced["best"] == "colocated"  # the first of the best on a tie
    assert balanced["ratio"] == 1.0 and balanced["met"] is True


def test_good_requests_are_pooled_over_repeats_before_the_ratio():
    def shorts(n, ttft):
        return [rec(f"short-{i}", ttft, 30) for i in range(n)]
    # per repeat auto is 2 behind then 2 ahead: pooled it is even
    runs = {"colocated": [shorts(5, 150), shorts(1, 150)], "disagg": [shorts(5, 900)], "threshold": [[]],
            "auto": [shorts(3, 150), shorts(3, 150)]}
    balanced = score_cells(B, ["short"], runs)["balanced"]
    assert balanced["good"]["colocated"] == 6 and balanced["good"]["auto"] == 6 and balanced["met"] is True
    assert balanced["sent"] == {"colocated": 6, "disagg": 5, "threshold": 0, "auto": 6}


def test_met_is_null_where_the_best_has_fewer_than_five_good_requests():
    assert compare({"colocated": 4, "disagg": 0, "threshold": 1, "auto": 0})["best_good"] == 4
    runs = {"colocated": [[rec(f"short-{i}", 150, 30) for i in range(4)]], "disagg": [[]], "threshold": [[]],
            "auto": [[]]}
    cell = score_cells(B, ["short"], runs)["balanced"]
    assert cell["met"] is None and cell["ratio"] == 0.0
    runs["colocated"][0].append(rec("short-9", 150, 30))  # five: now judged, and missed
    assert score_cells(B, ["short"], runs)["balanced"]["met"] is False
    runs["auto"] = [[rec(f"short-{i}", 150, 30) for i in range(4)]]  # one behind: met
    assert score_cells(B, ["short"], runs)["balanced"]["met"] is True


def test_a_cells_gap_is_split_by_whether_auto_routed_each_request_as_the_best_did():
    """Repeat by repeat, request by request: in the first, short-0..3 took the best's route
    (one good in auto's run only, two in the best's only, one in both) and short-4..5
    another (auto lost one the best kept); the second repeat pairs with the best's second
    run only (short-0, good in auto's)."""
    best = [[rec("short-0", 150, 30), rec("short-1", 150, 30), rec("short-2", 150, 30), rec("short-3", 400, 30),
             rec("short-4", 150, 30, route="local"), rec("short-5", 150, 30, route="local")],
            [rec("short-0", 400, 30)]]
    auto = [[rec("short-0", 150, 30), rec("short-1", 400, 30), rec("short-2", 400, 30), rec("short-3", 150, 30),
             rec("short-4", 400, 30, route="disagg"), rec("short-5", 150, 30, route="disagg")],
            [rec("short-0", 150, 30)]]
    runs = {"colocated": best, "disagg": [[], []], "threshold": [[], []], "auto_tight": auto}
    tight = score_cells(B, ["short"], runs)["tight"]
    assert tight["best"] == "colocated" and tight["good"]["auto"] == 4 and tight["good"]["colocated"] == 5
    assert tight["route_split"] == {"same_route": {"requests": 5, "auto_only": 2, "best_only": 2},
                                    "other_route": {"requests": 2, "auto_good": 1, "best_good": 2}}
    assert "routed differently 2 (good: auto 1, best 2)" in describe(tight["route_split"])


def figures(goodput: float = 1.0) -> dict:
    return {"completed": 5, "failed": 0, "ttft_p50_ms": 100.0, "itl_p99_ms": 50.0, "goodput_rps": goodput,
            "goodput_fraction": 1.0, "routes": {"local": 5}, "cpu_s": {}, "short_itl_p99_ms": 40.0}


def fake_run(records: list[RequestRecord], error: dict | None = None) -> RunResult:
    return RunResult(figures(), records, error)


def test_ratio_names_and_targets_of_a_whole_report():
    """Every cell of every workload has its `auto_goodput_vs_best_<workload>_<cell>`, and
    no other ratio key starts with `auto_goodput_vs_best_<workload>_`."""
    workloads = bench_workloads(B)
    error = {"local": {"ttft_mape": 0.1, "ttft_samples": 10, "tpot_mape": 0.05, "tpot_samples": 9}}
    runs = {name: {c.name: [fake_run([rec(f"{w.classes[0].name}-{i}", 150, 30) for i in range(6)],
                                     error if c.cell else None)] for c in CONFIGS}
            for name, w in workloads.items()}
    report = build_report(B, workloads, runs, {}, None)
    ratios = report["ratios"]
    for name in workloads:
        prefixed = {k for k in ratios if k.startswith(f"auto_goodput_vs_best_{name}_")}
        assert prefixed == {f"auto_goodput_vs_best_{name}_{cell}" for cell in CELLS}, name
        assert f"auto_goodput_vs_best_{name}" in ratios  # the old ratio of medians stays
    assert ratios["auto_goodput_vs_colocated_mixed_balanced"] == 1.0
    assert ratios["auto_goodput_vs_disagg_mixed_balanced"] == 1.0
    assert ratios["prediction_ttft_mape_local"] == 0.1 and ratios["prediction_tpot_mape_local"] == 0.05
    targets = report["targets"]
    assert targets["auto_goodput_vs_best_mixed_tight"]["met"] is True
    assert targets["auto_goodput_vs_best_mixed_tight"]["best_good"] == 6
    assert targets["prediction_ttft_mape_local"] == {"target": "<= 0.15", "value": 0.1, "met": True}
    assert targets["auto_goodput_vs_colocated_mixed_balanced"]["met"] is False  # 1.0 < 1.09
    assert report["prediction"]["router_side"]["local"]["ttft_samples"] == 10 * 5 * 3
    json.dumps(report)  # the whole report is JSON


def test_the_repeat_spread_compares_the_same_request_across_repeats():
    """Two repeats of the same trace: short-0 took 100 then 150 ms to its first token
    (|a - b| / b both ways: 1/3 and 1/2), short-1 100 both times (0 and 0), short-2
    completed once; the figure is the median of the four. Every `auto` configuration
    pools into `auto*`, whose figure per workload is a ratio beside the prediction error."""
    from cluster.bench.cluster_report import spread_ratios
    from cluster.bench.repeat_spread import repeat_spread, spread_by_config

    first = [rec("short-0", 100, 20), rec("short-1", 100, 20), rec("short-2", 100, 20)]
    second = [rec("short-0", 150, 20), rec("short-1", 100, 20), rec("short-2", 100, 20, ok=False)]
    spread = repeat_spread([first, second])
    assert spread == {"ttft": pytest.approx((0 + 1 / 3) / 2, abs=1e-4), "ttft_samples": 4, "tpot": 0.0, "tpot_samples": 4}
    assert repeat_spread([first]) == {}  # one repeat: nothing to compare
    runs = {"colocated": [fake_run(first), fake_run(second)], "auto": [fake_run(first), fake_run(first)],
            "auto_tight": [fake_run(first), fake_run(second)]}
    by_config = spread_by_config(runs)
    assert by_config["auto"]["ttft"] == 0.0 and by_config["auto*"]["ttft_samples"] == 6 + 4
    assert spread_ratios({"mixed": by_config}) == {"repeat_spread_ttft_auto_mixed": by_config["auto*"]["ttft"],
                                                   "repeat_spread_tpot_auto_mixed": 0.0}


def test_disagg_hurts_is_long_enough_with_fifteen_long_prompts_each_side_of_the_fault():
    w = disagg_hurts(B)
    rows = w.rows()
    at = fault_at_s(w)
    longs = [r["timestamp"] for r in rows if request_class(r["id"]) == "long"]
    assert sum(t < at for t in longs) >= 15 and sum(t > at for t in longs) >= 15
    assert max(longs) - min(longs) + (longs[1] - longs[0]) >= 90.0
    assert {r["workload"] for r in rows} == {"bench_short", "bench_long"}
    # the fault adds FAULT_TAIL_X unloaded long-prompt TTFTs to every transfer, over its
    # layers: enough that a remote long prompt misses a 5x TTFT objective
    assert fault_delay_s(B, 8) * 8 == pytest.approx(FAULT_TAIL_X * B.ttft_long_ms / 1000.0, abs=1e-3)
    assert 4.0 <= FAULT_TAIL_X < 5.0
    # a slow machine spaces the long prompts further instead of overloading
    slow = disagg_hurts(Baseline(100.0, 4000.0, 20.0))
    assert slow.classes[1].interval_s == 6.0


def test_remote_share_before_and_in_the_window_after_the_fault():
    def long(i, at, route):
        return rec(f"long-{i}", 1000, 30, at_s=at, route=route)
    records = [long(0, 1, "disagg"), long(1, 5, "disagg"), long(2, 9, "local"), long(3, 11, "disagg"),
               long(4, 20, "local"), long(5, 30, "local"), long(6, 10 + WINDOW_S + 1, "disagg"),
               rec("short-0", 100, 20, at_s=12, route="disagg"), long(7, 15, None)]
    shift = remote_shift(records, fault_s=10.0)
    assert shift["before"] == pytest.approx(2 / 3) and shift["num_before"] == 3
    assert shift["after"] == pytest.approx(1 / 3) and shift["num_after"] == 3  # shorts, no-route, late: out
    assert shift["after_vs_before"] == 0.5
    none_before = remote_shift([long(0, 1, "local"), long(1, 12, "disagg")], fault_s=10.0)
    assert none_before["before"] == 0.0 and none_before["after_vs_before"] is None


def test_load_shift_halves_do_not_overlap_and_are_scored_apart():
    w = load_shift(B, half_s=20.0)
    at = shift_at_s(w)
    rows = w.rows()
    assert at == 20.0
    assert all(r["timestamp"] < at for r in rows if r["id"].startswith("short"))
    assert all(r["timestamp"] >= at for r in rows if r["id"].startswith("long"))
    assert sum(r["id"].startswith("long") for r in rows) == int(20.0 / (1.0 / 1.1))  # 110% of one replica
    records = [rec("short-0", 150, 30, at_s=1.0), rec("long-0", 1000, 30, at_s=20.0)]
    parts = halves(records, at)
    assert [r.request_id for r in parts["first_half"]] == ["short-0"]
    assert [r.request_id for r in parts["second_half"]] == ["long-0"]
    slos = cell_slos(B, "balanced", ["short", "long"])
    shorts = [rec(f"short-{i}", 150, 30, at_s=i) for i in range(6)]
    slow_longs = [rec(f"long-{i}", 9000, 30, at_s=20 + i) for i in range(6)]
    good_longs = [rec(f"long-{i}", 2000, 30, at_s=20 + i) for i in range(6)]
    scored = score_load_shift({"colocated": shorts + slow_longs, "disagg": shorts[:2] + good_longs,
                               "threshold": [], "auto": shorts + good_longs}, slos, at)
    assert scored["first_half"]["good"] == {"colocated": 6, "disagg": 2, "threshold": 0, "auto": 6}
    assert scored["second_half"]["best"] == "disagg" and scored["second_half"]["ratio"] == 1.0


def test_scenario_targets_judge_only_with_enough_good_requests():
    slos = cell_slos(B, "balanced", ["short", "long"])
    few = {"colocated": [rec("short-0", 150, 30)], "disagg": [], "threshold": [],
           "auto": [rec("long-0", 1000, 30, at_s=1, route="disagg"), rec("long-1", 1000, 30, at_s=20, route="local")]}
    scored = {"disagg_hurts": score_disagg_hurts(few, slos, fault_s=10.0)}
    ratios = {"auto_goodput_vs_best_disagg_hurts": scored["disagg_hurts"]["ratio"],
              "disagg_hurts_long_remote_share_after_vs_before": 0.0}
    targets = scenario_targets(scored, ratios)
    assert targets["auto_goodput_vs_best_disagg_hurts"]["met"] is None  # best had 1 good request
    assert targets["disagg_hurts_long_remote_share_after_vs_before"]["met"] is True
    assert scored["disagg_hurts"]["long_remote_share"]["num_after"] == 1


def test_router_side_errors_pool_as_the_sample_weighted_median():
    assert weighted_median([(0.3, 1), (0.1, 10), (0.2, 1)]) == 0.1
    assert weighted_median([(0.1, 1), (0.2, 1)]) == 0.1 and weighted_median([]) is None
    pooled = pool_errors([{"disagg": {"ttft_mape": 0.2, "ttft_samples": 3}},
                          None, {"disagg": {"ttft_mape": 0.1, "ttft_samples": 2, "tpot_mape": 0.05, "tpot_samples": 2}}])
    assert pooled == {"disagg": {"ttft_mape": 0.2, "ttft_samples": 5, "tpot_mape": 0.05, "tpot_samples": 2}}
    leaning = pool_errors([{"local": {"ttft_mape": 0.2, "ttft_bias": 1.2, "ttft_samples": 3}},
                           {"local": {"ttft_mape": 0.1, "ttft_bias": 0.9, "ttft_samples": 1}}])
    assert leaning == {"local": {"ttft_mape": 0.2, "ttft_bias": 1.2, "ttft_samples": 4}}


def test_trace_rows_name_their_class_workload_and_the_load_tester_sends_it(tmp_path):
    trace = bench_workloads(B)["mixed"].write_trace(tmp_path / "trace.jsonl")
    plan = build_plan(LoadTestConfig(url="http://x", trace=trace))
    assert {(s.request_id.split("-")[0], s.workload) for s in plan.specs} == {
        ("short", "bench_short"), ("long", "bench_long")}
    # a row without `workload` keeps the old name
    (tmp_path / "plain.jsonl").write_text('{"timestamp": 0, "prompt_len": 5}\n')
    assert build_plan(LoadTestConfig(url="http://x", trace=tmp_path / "plain.jsonl")).specs[0].workload == "trace"


def test_scenarios_run_auto_before_the_fixed_pd_configurations():
    from cluster.bench.cluster_runs import SCENARIO_CONFIGS, SCENARIO_ORDER

    assert sorted(SCENARIO_ORDER) == sorted(c.name for c in SCENARIO_CONFIGS)
    pd = [name for name in SCENARIO_ORDER if next(c for c in SCENARIO_CONFIGS if c.name == name).app == "pd"]
    assert pd[0] == "auto"
