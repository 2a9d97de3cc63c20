"""The load tester's precise accuracy at 100 requests/s against the fake server of known
timing (docs/loadtest.md, "Accuracy"). Slow, so not part of `make test`:

    .venv/bin/python -m pytest -m slow tests/test_loadtest_accuracy.py -s

PDC_ACC_RATE (100), PDC_ACC_REQUESTS (1000), PDC_ACC_CLIENTS (1) change the load. It prints
each figure's relative error and asserts the goal: every one within 5%.
"""

from __future__ import annotations

import os

import pytest

from cluster.loadtest.api import run_loadtest
from cluster.loadtest.config import LoadTestConfig
from tests.fake_openai_server import FakeServer

TTFT_MS, TPOT_MS, OUTPUT_LEN = 100.0, 10.0, 32


@pytest.mark.slow
def test_accuracy_at_100_requests_per_second(tmp_path):
    rate = float(os.environ.get("PDC_ACC_RATE", 100))
    num_requests = int(os.environ.get("PDC_ACC_REQUESTS", 1000))
    clients = int(os.environ.get("PDC_ACC_CLIENTS", 1))
    workload = tmp_path / "fixed.yaml"
    workload.write_text(f"workload: chat-short\nprompt_len: [64, 256]\noutput_len: {OUTPUT_LEN}\n")
    with FakeServer(ttft_ms=TTFT_MS, tpot_ms=TPOT_MS) as server:
        s = run_loadtest(LoadTestConfig(url=server.url, out_dir=tmp_path / "run", workload=str(workload), rate=rate,
                                        num_requests=num_requests, clients=clients, plots=False))
        server_lag = server.stats()["loop_lag_ms"]
    e2e_truth = TTFT_MS + (OUTPUT_LEN - 1) * TPOT_MS
    figures = {
        "achieved rate vs schedule": (s.rate["achieved"], s.env["schedule_rate"]),
        "achieved rate vs target": (s.rate["achieved"], rate),
        "TTFT mean": (s.ttft_ms["mean"], TTFT_MS),
        "TTFT p50": (s.ttft_ms["p50"], TTFT_MS),
        "TTFT p99": (s.ttft_ms["p99"], TTFT_MS),
        "TPOT mean": (s.tpot_ms["mean"], TPOT_MS),
        "ITL p50": (s.itl_ms["p50"], TPOT_MS),
        "ITL mean": (s.itl_ms["mean"], TPOT_MS),
        "E2E p50": (s.e2e_ms["p50"], e2e_truth),
    }
    print(f"\naccuracy at {rate:g} req/s, {num_requests} requests, {clients} client(s); "
          f"schedule lag ms {s.env['schedule_lag_ms']}\n"
          f"event-loop lag ms: client {s.env['client_loop_lag_ms']}, server {server_lag}")
    print(f"{'figure':28} {'measured':>10} {'truth':>10} {'error':>8}")
    errors = {}
    for name, (measured, truth) in figures.items():
        errors[name] = (measured - truth) / truth
        print(f"{name:28} {measured:10.3f} {truth:10.3f} {100 * errors[name]:+7.2f}%")
    assert s.requests == {"completed": num_requests, "failed": 0}
    goal = {k: v for k, v in errors.items() if k not in ("achieved rate vs target", "TTFT p99")}
    assert all(abs(e) <= 0.05 for e in goal.values()), goal
