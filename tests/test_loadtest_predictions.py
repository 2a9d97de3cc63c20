"""The router's predicted TTFT/TPOT (`x-pd-predicted-ttft-ms`, `x-pd-predicted-tpot-ms`) in
the load tester: read per request, kept in requests.jsonl, and compared with what the
client measured per route in summary.json, the table and `compare`. Synthetic records for
the arithmetic; the real HTTP path against tests/fake_openai_server.py told to predict half
its true timing."""

from __future__ import annotations

import json

import httpx
import pytest
from rich.console import Console

from cluster.loadtest.api import run_loadtest
from cluster.loadtest.client import RequestRecord, _header_ms_as_s
from cluster.loadtest.compare import compare
from cluster.loadtest.config import SLO, LoadTestConfig
from cluster.loadtest.metrics import SUMMARY_KEYS, summarize
from cluster.loadtest.predictions import prediction_error
from cluster.loadtest.report import (
    flatten,
    prediction_table,
    print_summary,
    read_records,
    read_summary,
    write_report,
)
from tests.fake_openai_server import FakeServer


def _record(i, route, ttft, e2e, n, predicted_ttft=None, predicted_tpot=None, ok=True):
    r = RequestRecord(i, f"r{i}", "w", None, sent_at_s=i * 0.1, ended_at_s=i * 0.1 + e2e, ttft_s=ttft, e2e_s=e2e,
                      completion_tokens=n, num_chunks=n, route=route, predicted_ttft_s=predicted_ttft,
                      predicted_tpot_s=predicted_tpot, itl_s=[(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else [])
    if not ok:
        r.error_kind = "http_500"
    return r


def synthetic_records() -> list[RequestRecord]:
    return [
        # local: TTFT measured 0.10 / 0.20 / 0.30 against 0.08 / 0.25 / 0.30 predicted
        _record(0, "local", 0.10, 1.10, 11, 0.08, 0.10),  # TPOT 0.100 measured, 0.100 predicted
        _record(1, "local", 0.20, 0.70, 11, 0.25, 0.04),  # TPOT 0.050 measured, 0.040 predicted
        _record(2, "local", 0.30, 0.30, 1, 0.30, 0.01),  # one token: no TPOT sample
        _record(3, "local", 0.01, 0.02, 5, 0.5, 0.5, ok=False),  # failed: never a sample
        _record(4, "local", 0.40, 0.50, 5),  # no headers (an older server): no sample
        # disagg: TPOT only (no TTFT header), so no TTFT keys
        _record(5, "disagg", 0.05, 0.45, 5, None, 0.05),  # TPOT 0.100 measured
        # a route whose answers never carried a prediction is left out
        _record(6, "other", 0.05, 0.45, 5),
    ]


def test_prediction_error_per_route_on_synthetic_records():
    result = prediction_error(synthetic_records())
    assert set(result) == {"local", "disagg"}
    local = result["local"]
    # |p - m| / m: 0.02/0.10 = 0.2, 0.05/0.20 = 0.25, 0 -> median 0.2; m / p: 1.25, 0.8, 1.0 -> 1.0
    assert local["ttft_mape"] == pytest.approx(0.2) and local["ttft_bias"] == pytest.approx(1.0)
    assert local["ttft_samples"] == 3
    # TPOT: 0/0.1 = 0 and 0.01/0.05 = 0.2 -> 0.1; m / p: 1.0 and 1.25 -> 1.125
    assert local["tpot_mape"] == pytest.approx(0.1) and local["tpot_bias"] == pytest.approx(1.125)
    assert local["tpot_samples"] == 2
    assert result["disagg"] == {"tpot_mape": pytest.approx(0.5), "tpot_bias": pytest.approx(2.0), "tpot_samples": 1}
    assert prediction_error([]) == {} and prediction_error(synthetic_records()[4:5]) == {}


def test_zero_or_missing_values_are_not_samples():
    records = [_record(0, "local", 0.1, 0.5, 5, 0.0, 0.1), _record(1, "local", 0.0, 0.0, 1, 0.1, 0.1)]
    assert prediction_error(records) == {"local": {"tpot_mape": 0.0, "tpot_bias": 1.0, "tpot_samples": 1}}


def test_summary_carries_prediction_error_only_when_streamed():
    records = synthetic_records()
    s = summarize(records, SLO(), None, {"stream": True})
    assert tuple(s.to_dict()) == SUMMARY_KEYS
    assert s.prediction_error == prediction_error(records)
    assert summarize(records, SLO(), None, {"stream": False}).prediction_error == {}
    console = Console(record=True, width=160)
    print_summary(s, console=console)
    text = console.export_text()
    assert "router predictions" in text
    assert [line.split() for line in text.splitlines() if line.startswith(("│ local", "│ disagg"))] == [
        ["│", "disagg", "│", "-", "│", "-", "│", "-", "│", "50.0%", "│", "×2.00", "│", "1", "│"],
        ["│", "local", "│", "20.0%", "│", "×1.00", "│", "3", "│", "10.0%", "│", "×1.12", "│", "2", "│"]]
    assert prediction_table(summarize(records[4:5], SLO(), None, {})) is None


def test_requests_jsonl_and_summary_keep_the_predictions(tmp_path):
    records = synthetic_records()
    summary = summarize(records, SLO(), None, {"stream": True})
    write_report(tmp_path, summary, records, plots=False)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert rows[0]["predicted_ttft_ms"] == 80.0 and rows[0]["predicted_tpot_ms"] == 100.0
    assert rows[4]["predicted_ttft_ms"] is None and rows[4]["predicted_tpot_ms"] is None
    assert [r.predicted_ttft_s for r in read_records(tmp_path)] == [r.predicted_ttft_s for r in records]
    assert read_summary(tmp_path).prediction_error == summary.prediction_error
    assert flatten(summary)["prediction_error.local.ttft_mape"] == pytest.approx(0.2)


def test_compare_reads_runs_from_before_predictions(tmp_path):
    records = synthetic_records()
    new, old = tmp_path / "new", tmp_path / "old"
    write_report(new, summarize(records, SLO(), None, {}), records, plots=False)
    old_records = records[4:5]
    write_report(old, summarize(old_records, SLO(), None, {}), old_records, plots=False)
    data = json.loads((old / "summary.json").read_text())
    del data["prediction_error"]  # as written before the field existed
    (old / "summary.json").write_text(json.dumps(data))
    rows = {r["metric"]: r for r in compare([old, new], tmp_path / "cmp")["rows"]}
    assert rows["ttft prediction MAPE local"]["values"] == [None, pytest.approx(0.2)]
    assert rows["tpot prediction MAPE disagg"]["values"] == [None, pytest.approx(0.5)]
    assert "ttft prediction MAPE disagg" not in rows  # no run has it
    rows = {r["metric"] for r in compare([old], tmp_path / "cmp-old")["rows"]}
    assert not any("prediction" in label for label in rows)


def test_header_parsing():
    def parse(value):
        return _header_ms_as_s(httpx.Headers({} if value is None else {"x-p": value}), "x-p")

    assert parse("12.5") == pytest.approx(0.0125) and parse(" 3 ") == pytest.approx(0.003)
    assert parse(None) is None and parse("") is None and parse("soon") is None
    assert parse("nan") is None and parse("inf") is None


TTFT_MS, TPOT_MS = 40.0, 10.0


@pytest.fixture(scope="module")
def predicting_server():
    # Predicts half the truth, so the measured/predicted ratio is about 2 however loaded
    # the machine is (client overheads only push it up); every 5th request fails.
    with FakeServer(ttft_ms=TTFT_MS, tpot_ms=TPOT_MS, disagg_min_prompt=150, predicted_scale=0.5,
                    error_every=5) as s:
        yield s


def test_headers_over_real_http(predicting_server, tmp_path):
    out = tmp_path / "run"
    config = LoadTestConfig(url=predicting_server.url, out_dir=out, plots=False, rate=40.0, num_requests=20,
                            mode="threshold", seed=3)
    summary = run_loadtest(config)
    assert summary.env["mode"] == "threshold"
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    failed = [r for r in rows if not r["ok"]]
    assert failed and all(r["predicted_ttft_ms"] is None and r["predicted_tpot_ms"] is None for r in failed)
    done = [r for r in rows if r["ok"]]
    assert {(r["predicted_ttft_ms"], r["predicted_tpot_ms"]) for r in done} == {(TTFT_MS / 2, TPOT_MS / 2)}
    assert set(summary.prediction_error) == {r["route"] for r in done}
    for route, block in summary.prediction_error.items():
        num_done = sum(r["route"] == route for r in done)
        assert block["ttft_samples"] == block["tpot_samples"] == num_done
        assert 1.8 <= block["ttft_bias"] < 6 and 0.45 <= block["ttft_mape"] < 1
        assert 1.6 <= block["tpot_bias"] < 3 and 0.35 <= block["tpot_mape"] < 1
    on_disk = json.loads((out / "summary.json").read_text())["prediction_error"]
    assert on_disk == summary.prediction_error


def test_unstreamed_answers_carry_predictions_but_no_comparison(predicting_server, tmp_path):
    config = LoadTestConfig(url=predicting_server.url, out_dir=tmp_path / "run", plots=False, concurrency=2,
                            num_requests=4, stream=False)
    summary = run_loadtest(config)
    records = [r for r in read_records(config.out_dir) if r.ok]
    assert records and all(r.predicted_ttft_s == pytest.approx(TTFT_MS / 2000) for r in records)
    assert summary.prediction_error == {}
