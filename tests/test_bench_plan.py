"""`bench plan`'s report: every figure of every judged run reaches `results` and
`ratios`; the targets judge the 30% and 60% points only, the saturation error, the
rankings and each calibration's held-out error."""

from __future__ import annotations

from pathlib import Path

from cluster.bench.plan import PlanBenchOptions, build_report, start_rate
from cluster.bench.sizing import Baseline


def _figures(error: float) -> dict:
    names = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "throughput_rps",
             "goodput_rps", "goodput_fraction")
    return {n: {"measured": 100.0, "predicted": 100.0 * (1 + error), "error": error} for n in names}


def _validation(out: Path, load_error: dict, saturation_error: float, agree: bool = True) -> tuple[dict, dict]:
    runs, searches, loads = [], [], {}
    for workload in ("chat-short", "rag-long"):
        for name in ("colocated", "pd"):
            searches.append({"search": str(out / workload / name / "search"), "workload": workload,
                             "measured": {"rate": 9.0, "high": 10.0, "estimate": 9.49},
                             "predicted": {"rate": 9.49 * (1 + saturation_error)}, "error": saturation_error})
            for fraction in (0.3, 0.6, 0.85):
                run = out / workload / name / f"load-{round(fraction * 100)}"
                loads[(workload, name, fraction)] = run
                runs.append({"run": str(run), "rate": fraction * 9.49, "figures": _figures(load_error[fraction]),
                             "routes": {"measured": {}, "predicted": {}}})
    rankings = {w: {"measured": ["a", "b"], "predicted": ["a", "b"], "agree": agree} for w in ("chat-short", "rag-long")}
    calibrations = {"2-colocated": {"held_out_median_error": 0.08}, "1P+1D": {"held_out_median_error": 0.3}}
    return {"runs": runs, "searches": searches, "rankings": rankings, "calibrations": calibrations}, loads


def test_the_targets_judge_the_30_and_60_percent_points_only(tmp_path):
    validation, loads = _validation(tmp_path, {0.3: 0.05, 0.6: -0.09, 0.85: 3.0}, 0.04)
    report = build_report(validation, loads, PlanBenchOptions())
    t = report["targets"]
    assert t["replay_ttft_p50_ms_max_abs_error"] == {"target": "<= 0.15", "value": 0.09, "met": True}
    assert t["replay_itl_p50_ms_max_abs_error"]["met"] and t["replay_tpot_p50_ms_max_abs_error"]["met"]
    assert t["saturation_rate_max_abs_error"]["met"] and t["ranking_rag-long"]["met"]
    assert t["held_out_step_error_2-colocated"]["met"] and not t["held_out_step_error_1P+1D"]["met"]
    block = report["results"]["rag-long"]["pd"]
    assert set(block["loads"]) == {"30", "60", "85"} and block["saturation"]["bracket"] == [9.0, 10.0]
    assert report["ratios"]["rag-long_pd_load85_ttft_p50_ms_error"] == 3.0  # reported, not judged
    assert report["ratios"]["chat-short_colocated_saturation_error"] == 0.04


def test_a_miss_anywhere_judged_fails_its_target(tmp_path):
    validation, loads = _validation(tmp_path, {0.3: 0.2, 0.6: 0.0, 0.85: 0.0}, -0.12, agree=False)
    t = build_report(validation, loads, PlanBenchOptions())["targets"]
    assert not t["replay_ttft_p50_ms_max_abs_error"]["met"] and t["replay_ttft_p90_ms_max_abs_error"]["met"]
    assert t["saturation_rate_max_abs_error"]["value"] == 0.12 and not t["saturation_rate_max_abs_error"]["met"]
    assert not t["ranking_chat-short"]["met"]


def test_the_search_starts_near_what_the_replicas_could_take():
    b = Baseline(ttft_short_ms=25.0, ttft_long_ms=80.0, tpot_ms=4.0)
    assert start_rate(b, "rag-long", "colocated") == round(2 / 0.172, 3)  # two replicas, 80 ms + 23 x 4 ms each
    assert start_rate(b, "chat-short", "colocated") > start_rate(b, "chat-short", "pd") > 0
