"""A router replica's recent routing decisions, each with what the policy saw, every
candidate it priced and, once the request finished, what the router measured beside what
it predicted (`GET /admin/decisions`): why a request went where it went, and how that
turned out.

Recording keeps references only (the request's placement, which holds the context the
policy read and its decision); entries are formatted when read, so the hot path pays an
append to a bounded deque.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.placement import Placement
from router.policy import Alternative
from router.replica_load import ReplicaLoad

DECISION_LOG_SIZE = 512  # decisions kept per router replica


@dataclass(frozen=True)
class _Entry:
    request_id: str
    workload: str
    at: float  # unix seconds, when it was decided
    placement: Placement


class DecisionLog:
    def __init__(self, size: int = DECISION_LOG_SIZE, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: deque[_Entry] = deque(maxlen=size)
        self.clock = clock  # the policy's clock, which stamps `Placement.placed_at`

    def record(self, request_id: str, workload: str, placement: Placement, at: float | None = None) -> None:
        """`at`: the decision's Unix time (default: when it was placed, `placed_at` read on
        the wall clock; a request is recorded once its call started, a TTFT later)."""
        if at is None:
            at = time.time() - max(0.0, self.clock() - placement.placed_at)
        self._entries.append(_Entry(request_id, workload, at, placement))

    def read(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` decisions, oldest first."""
        entries = list(self._entries)[-limit:] if limit > 0 else []
        return [describe(e.request_id, e.workload, e.at, e.placement) for e in entries]

    def clear(self) -> None:
        self._entries.clear()


def describe(request_id: str, workload: str, at: float, placement: Placement) -> dict[str, Any]:
    decision, ctx = placement.decision, placement.context
    return {
        "request_id": request_id, "at": round(at, 3), "workload": workload,
        "prompt_len": placement.prompt_len, "max_tokens": placement.max_tokens,
        "route": decision.route, "reason": decision.reason,
        "kind": decision.candidate.kind if decision.candidate is not None else None,
        **_predicted_and_measured(placement),
        "decode_replica": placement.target_replica, "prefill_replica": placement.prefill_on,
        "decode": _load(ctx.decode) if ctx is not None and ctx.decode is not None else None,
        "prefills": [_load(p) for p in ctx.prefills] if ctx is not None else [],
        "alternatives": [_alternative(a) for a in decision.alternatives],
    }


def _predicted_and_measured(placement: Placement) -> dict[str, float | None]:
    """What the response headers said (corrected) beside what the router then measured
    (arrival to first token; the mean gap after it), the called worker's own TTFT
    (from the call to its first token: the rest is the hop) and, disaggregated, the KV
    transfer's tail the prefill replica measured; None until the request finished (the
    worker's and the tail, also where they were not said)."""
    shown = placement.decision.prediction
    return {"predicted_ttft_ms": _ms(shown.ttft_s) if shown else None,
            "predicted_tpot_ms": _ms(shown.tpot_s) if shown else None,
            "measured_ttft_ms": _ms(placement.measured_ttft_s), "measured_tpot_ms": _ms(placement.measured_tpot_s),
            "worker_ttft_ms": _ms(placement.worker_ttft_s), "transfer_tail_ms": _ms(placement.transfer_tail_s)}


def _load(r: ReplicaLoad) -> dict[str, Any]:
    """What the policy read of one replica."""
    return {"replica": r.replica_id, "queue_tokens": r.queue_tokens, "requests": r.num_requests,
            "streams": r.num_streams, "queued_streams": r.queued_streams,
            "stream_allowance_ms": _ms(r.stream_tpot_slo_s),
            "stream_allowances_ms": [round(a * 1e3, 3) for a in r.stream_allowances],
            "recent_gap_ms": _ms(r.recent_gap_s),
            "node_busy": r.node_busy, "arrival_rate": round(r.arrival_rate, 3),
            "prompt_token_rate": round(r.prompt_token_rate, 1), "prompt_rate": round(r.prompt_rate, 3),
            "incoming_due_ms": [round(a * 1e3, 3) for a in r.incoming_due_s],
            "transfer_waiting_ms": {peer: round(s * 1e3, 3) for peer, s in r.transfer_waiting.items()}}


def _alternative(a: Alternative) -> dict[str, Any]:
    c, p = a.candidate, a.prediction
    return {"kind": c.kind, "decode_replica": c.decode_replica, "prefill_replica": c.prefill_replica,
            "chunk_tokens": c.chunk_tokens, "ttft_ms": _ms(p.ttft_s), "transfer_ms": _ms(p.transfer_s),
            "tpot_ms": _ms(p.tpot_s),
            "streams_tpot_ms": _ms(p.streams_tpot_s), "streams": c.num_streams,
            "host_streams_tpot_ms": _ms(p.host_streams_tpot_s), "host_streams": c.host_streams, "meets": a.meets,
            "loss": round(a.loss, 4), "joining_streams": round(c.joining_streams, 3),
            "blocking_ms": _ms(c.blocking_s)}


def _ms(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return round(seconds * 1e3, 3) if seconds != float("inf") else None
