"""What a simulated run gives back: one load-tester `RequestRecord` per request, so the
load tester's own summary (percentiles, goodput, routes, prediction error) reads a
simulated run exactly as a real one, plus each pool's utilisation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.loadtest.metrics import Summary, summarize


@dataclass
class SimRequest:
    """One request's path through the simulated cluster."""

    index: int
    request_id: str
    workload: str
    arrival_s: float
    prompt_len: int
    output_len: int
    placement: object = None  # router.placement.Placement
    dispatched_at: float | None = None  # the call reached the replica the router placed it on
    first_at: float | None = None
    end_at: float | None = None
    transfer_tail_s: float | None = None  # disagg: its KV's time on the network after the prefill
    token_steps: list = field(default_factory=list)  # (engine step_ends, segments) of the decoding sequence
    decode_seq: object = None  # disagg: the sequence holding its reserved blocks on the decode replica
    fallback: str | None = None  # the worker's own reason when it prefilled locally instead (decode-busy)

    def token_times(self) -> np.ndarray:
        step_ends, segments = self.token_steps
        parts = [np.frombuffer(step_ends, dtype=np.float64)[a:b + 1] for a, b in segments]
        return np.concatenate(parts) if parts else np.empty(0)

    def record(self) -> RequestRecord:
        decision = self.placement.decision
        prediction = decision.prediction
        times = self.token_times()
        return RequestRecord(
            self.index, self.request_id, self.workload, self.arrival_s, sent_at_s=self.arrival_s,
            ended_at_s=self.end_at, ttft_s=self.first_at - self.arrival_s, e2e_s=self.end_at - self.arrival_s,
            itl_s=np.diff(times).tolist(), num_chunks=len(times), prompt_tokens=self.prompt_len,
            completion_tokens=self.output_len, target_prompt_len=self.prompt_len,
            target_output_len=self.output_len, status=200, route="local" if self.fallback else decision.route,
            reason=self.fallback or decision.reason,
            predicted_ttft_s=prediction.ttft_s if prediction is not None else None,
            predicted_tpot_s=prediction.tpot_s if prediction is not None else None)


@dataclass(frozen=True)
class SimResult:
    records: list[RequestRecord]
    utilisation: dict[str, float]  # pool -> busy share of its replicas' time over the run
    duration_s: float  # simulated: the first arrival to the last request's end
    num_preemptions: int
    num_steps: int
    num_events: int
    num_transfers: int
    wall_s: float  # the simulation's own run time
    decision_wall_s: float  # of which in the real placement and policy code
    target_rate: float | None = None
    feedback_wall_s: float = 0.0  # and in the router's bookkeeping of first tokens and outcomes

    def summary(self, slo: SLO = SLO(), env: dict | None = None) -> Summary:
        """The load tester's `summary.json` of this run."""
        return summarize(self.records, slo, self.target_rate, {"simulated": True, "stream": True, **(env or {})})

    def routes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.route] = out.get(r.route, 0) + 1
        return out


def utilisation(busy_s: dict[str, Sequence[float]], duration_s: float) -> dict[str, float]:
    return {pool: (sum(values) / (len(values) * duration_s) if values and duration_s > 0 else 0.0)
            for pool, values in busy_s.items()}
