"""The per-request overhead outside the engine (the HTTP hop, tokenisation, the router),
measured from a run's `requests.jsonl` against the fitted step and transfer models.

Method: take the requests that were alone in flight for their whole time to first
token (no other request of the run was between sent and ended at any moment of it), so
the replicas were idle and no queue, batch or contention stretched them. For each, the
engine's share of its TTFT is the fitted model's: the prompt's prefill chunks on an idle
replica (`cost_model.prefill_work` at the token budget, one step per chunk), plus, on
the disaggregated route, the transfer's exposed tail. The overhead is the median of
(client-measured TTFT - that engine time), never below 0. A run with no such request
gives None: the caller leaves the overhead at 0 and says so.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cluster.loadtest.client import RequestRecord
from cluster.plan.calibration import StepModel, TransferModel
from workers.engine.cost_model import StepFeatures, prefill_work

REQUESTS_FILE = "requests.jsonl"
MIN_IDLE_REQUESTS = 3  # fewer: no estimate


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


def request_overhead_s(records: list[RequestRecord], step: StepModel, transfer: TransferModel, chunk: int,
                       kv_bytes_per_token: int) -> tuple[float | None, int]:
    """(median overhead in seconds or None, how many idle requests it is over)."""
    alone = idle_requests(records)
    if len(alone) < MIN_IDLE_REQUESTS:
        return None, len(alone)
    gaps = [r.ttft_s - engine_ttft_s(r.prompt_tokens or r.target_prompt_len or 1, r.route, step, transfer, chunk,
                                     kv_bytes_per_token) for r in alone]
    return max(0.0, statistics.median(gaps)), len(alone)
