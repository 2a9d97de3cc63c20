"""The per-request overhead outside the engine (the HTTP hop, tokenisation, the router),
measured from a run's `requests.jsonl` against the fitted step and transfer models.

Method: take the requests that were alone in flight for their whole time to first
token (no other request of the run was between sent and ended at any moment of it), so
the replicas were idle and no queue, batch or contention stretched them. For each, the
engine's share of its TTFT is the fitted model's: the prompt's prefill chunks on an idle
replica (`cost_model.prefill_work` at the token budget, one step per chunk), plus, on
the disaggregated route, the transfer's exposed tail. The overhead is what client TTFT
has beyond that engine time (`request_overhead_s`), never below 0. A run with no such request
gives None: the caller leaves the overhead at 0 and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cluster.loadtest.client import RequestRecord
from cluster.plan.calibration import StepModel, TransferModel
from workers.engine.cost_model import StepFeatures, prefill_work

REQUESTS_FILE = "requests.jsonl"
MIN_IDLE_REQUESTS = 3  # fewer: no estimate
SPREAD_FOR_A_LINE = 2.0  # longest over shortest engine TTFT: below this, no line is fitted


def read_requests(run_dir: str | Path) -> list[RequestRecord]:
    """The run's `requests.jsonl` as the load tester's records (none when it has no such file)."""
    from cluster.loadtest.report import read_records

    return read_records(Path(run_dir)) if (Path(run_dir) / REQUESTS_FILE).exists() else []


def idle_requests(records: list[RequestRecord]) -> list[RequestRecord]:
    """Completed requests that no other request overlapped between their send and their
    first token."""
    spans = [(r.sent_at_s, r.ended_at_s) for r in records if r.ended_at_s]
    alone = []
    for r in records:
        if not r.ok or r.ttft_s is None:
            continue
        start, first = r.sent_at_s, r.sent_at_s + r.ttft_s
        if sum(1 for s, e in spans if s < first and e > start) <= 1:  # itself
            alone.append(r)
    return alone


def engine_ttft_s(prompt_len: int, route: str | None, step: StepModel, transfer: TransferModel,
                  chunk: int, kv_bytes_per_token: int) -> float:
    """The fitted models' TTFT of one prompt on idle replicas."""
    c = step.coefficients()
    num_chunks, tokens, work = prefill_work(0, prompt_len, chunk)
    prefill = float(StepFeatures(tokens, work).row() @ c.vector()) + (num_chunks - 1) * c.fixed_s
    if route != "disagg":
        return prefill
    t = transfer.coefficients()
    return prefill + t.fixed_s + prompt_len * kv_bytes_per_token / t.bytes_per_s


def request_overhead_s(runs: Sequence[list[RequestRecord]], step: StepModel, transfer: TransferModel, chunk: int,
                       kv_bytes_per_token: int) -> tuple[float | None, int]:
    """(overhead in seconds or None, how many idle requests it is over), over the
    requests alone in flight in each run (each run's times are its own clock).

    With prompts of several lengths, the overhead is the intercept of client TTFT
    against the fitted engine TTFT (a Theil-Sen line: medians of pairwise slopes, robust
    to the stragglers of a shared machine), so an engine model off by a factor for lone
    prompts (a fit over loaded steps prices a lone long prompt high) moves the slope,
    not the overhead. With one length only, the median of the differences."""
    alone = [r for records in runs for r in idle_requests(records)]
    if len(alone) < MIN_IDLE_REQUESTS:
        return None, len(alone)
    engine = np.array([engine_ttft_s(r.prompt_tokens or r.target_prompt_len or 1, r.route, step, transfer, chunk,
                                     kv_bytes_per_token) for r in alone])
    client = np.array([r.ttft_s for r in alone])
    if engine.max() < SPREAD_FOR_A_LINE * engine.min():
        return max(0.0, float(np.median(client - engine))), len(alone)
    i, j = np.triu_indices(len(alone), k=1)
    dx = engine[j] - engine[i]
    keep = dx != 0
    slopes = (client[j] - client[i])[keep] / dx[keep]
    slope = max(0.0, float(np.median(slopes)))
    return max(0.0, float(np.median(client - slope * engine))), len(alone)
