"""The serving path's queue (`sim/frontend.py`) fitted to real runs: the work per request
and per streamed chunk that make the replayed runs' client-side TTFT (p50, p90) and ITL
p50 closest to the measured ones (squared log ratios, summed over runs), on a grid. The
engines are simulated once per run (by the caller, who keeps the results); each grid
point only re-delivers the tokens."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.metrics import summarize
from cluster.plan.replay import RecordedRun
from cluster.plan.sim.frontend import Frontend, apply

REQUEST_S = (0.0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)
CHUNK_S = (0.0, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016)
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"))


def fit_frontend(replayed: Sequence[tuple[RecordedRun, list[RequestRecord]]]) -> tuple[Frontend, float]:
    """(the best frontend on the grid, its mean squared log error per figure), over runs
    and their simulated records (`replay(run, calibration).records`)."""
    best, best_loss = Frontend(), math.inf
    for request_s, chunk_s in itertools.product(REQUEST_S, CHUNK_S):
        frontend = Frontend(request_s, chunk_s)
        loss = sum(_loss(run, apply(records, frontend)) for run, records in replayed)
        if loss < best_loss - 1e-12:
            best, best_loss = frontend, loss
    return best, best_loss / max(1, len(replayed) * len(FIGURES))


def _loss(run: RecordedRun, records) -> float:
    predicted = summarize(records, run.slo, run.target_rate, {"simulated": True}).to_dict()
    measured = run.summary.to_dict()
    total = 0.0
    for block, key in FIGURES:
        p, m = predicted[block].get(key), measured[block].get(key)
        if p and m and p > 0 and m > 0:
            total += math.log(p / m) ** 2
    return total
