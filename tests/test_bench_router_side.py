"""The bench's router-side view of a run: its decisions cut to the run, and the run's
router and worker TTFT medians, in every configuration."""

from __future__ import annotations

from cluster.bench.cluster_report import legacy_ratios
from cluster.bench.router_side import router_side_figures, run_decisions


def _decision(rid: str, at: float, ttft: float | None, worker: float | None) -> dict:
    return {"request_id": rid, "at": at, "measured_ttft_ms": ttft, "worker_ttft_ms": worker}


def test_run_decisions_keeps_the_run_and_the_rest_of_the_answer():
    log = {"router": "r1", "decisions": [_decision("aa11bb-short-0", 99.9, 50.0, 40.0),
                                         _decision("loadtest-probe", 100.0, 30.0, 20.0),
                                         _decision("cc22dd-short-0", 100.5, 80.0, 60.0)]}
    cut = run_decisions(log, 100.0)
    assert cut["router"] == "r1"
    assert [d["request_id"] for d in cut["decisions"]] == ["loadtest-probe", "cc22dd-short-0"]
    assert log["decisions"][0]["request_id"] == "aa11bb-short-0"  # the answer itself is left alone


def test_figures_count_only_the_runs_requests_by_their_load_tester_ids():
    decisions = [_decision("loadtest-probe", 0, 1.0, 1.0),
                 _decision("cc22dd-short-0", 0, 80.0, 60.0),
                 _decision("cc22dd-short-1", 0, 100.0, None),  # the worker did not say
                 _decision("cc22dd-short-2", 0, 120.0, 70.0),
                 _decision("cc22dd-mixed-3:long-1", 0, None, None)]  # not finished when read
    figures = router_side_figures(decisions, ["short-0", "short-1", "short-2", "mixed-3:long-1"])
    assert figures == {"router_ttft_p50_ms": 100.0, "worker_ttft_p50_ms": 65.0, "num_logged": 4}
    assert router_side_figures([], ["short-0"]) == {"router_ttft_p50_ms": None, "worker_ttft_p50_ms": None,
                                                    "num_logged": 0}


def test_short_low_load_ratios_split_the_client_ttft():
    def cfg(client, router, worker):
        return {"goodput_rps": 1.0, "itl_p99_ms": 100.0, "ttft_p50_ms": client,
                "router_ttft_p50_ms": router, "worker_ttft_p50_ms": worker}
    results = {"short_low_load": {"colocated": cfg(100.0, 90.0, 80.0), "disagg": cfg(150.0, 140.0, 130.0),
                                  "auto": cfg(110.0, 90.0, 88.0)}}
    ratios = legacy_ratios(results, None)
    assert ratios["auto_ttft_p50_vs_colocated_short_low_load"] == 1.1
    assert ratios["auto_router_ttft_p50_vs_colocated_short_low_load"] == 1.0  # the gap is the path
    assert ratios["auto_worker_ttft_p50_vs_colocated_short_low_load"] == 1.1
    results["short_low_load"]["colocated"].pop("worker_ttft_p50_ms")  # a run whose log said nothing
    assert legacy_ratios(results, None)["auto_worker_ttft_p50_vs_colocated_short_low_load"] is None
