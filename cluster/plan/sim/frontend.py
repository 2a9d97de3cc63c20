"""The serving path's own queue: what a client sees after the engines.

Between an engine emitting a token and the client reading it, the token passes through
the replica's stream, the router and the HTTP proxy, each a Python event loop on CPUs
that the engines may share. While that path is busy, work waits, and tokens of one
stream that queued meanwhile leave as one chunk. The model: one FIFO server per cluster
entry point, `request_s` of work per request as it arrives and `chunk_s` per chunk it
streams; a token that finds its stream's previous chunk still waiting joins it.

Applied after the engines are simulated, to the records: every token's delivery is
delayed by the wait its chunk had (not by the service itself, which the calibrated idle
overhead already holds, so an idle cluster reads the same with or without it), and a
request's first token by the wait its arrival had. The engines do not see the delay
(an approximation that holds while the path is not the bottleneck: past that the waits
grow without bound and the SLO is missed, which is what a saturation search needs).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster.loadtest.client import RequestRecord


@dataclass(frozen=True)
class Frontend:
    request_s: float = 0.0  # serving-path work per request
    chunk_s: float = 0.0  # serving-path work per streamed chunk

    @property
    def active(self) -> bool:
        return self.request_s > 0 or self.chunk_s > 0


def token_times(r: RequestRecord) -> np.ndarray:
    """When each chunk reached the client, on the run's clock."""
    if r.ttft_s is None:
        return np.empty(0)
    first = r.sent_at_s + r.ttft_s
    return first + np.concatenate(([0.0], np.cumsum(r.itl_s))) if r.itl_s is not None else np.array([first])


def apply(records: Sequence[RequestRecord], frontend: Frontend) -> list[RequestRecord]:
    """The records as the client would have seen them through the serving path's queue."""
    if not frontend.active:
        return list(records)
    jobs: list[tuple[float, int, int, int]] = []  # (ready, kind 0=request 1=token, record, token)
    times = [token_times(r) for r in records]
    for i, r in enumerate(records):
        if r.ok and r.ttft_s is not None:
            jobs.append((r.sent_at_s, 0, i, 0))
            jobs += [(float(t), 1, i, j) for j, t in enumerate(times[i])]
    heapq.heapify(jobs)
    free_at = 0.0
    request_wait = [0.0] * len(records)
    left = [np.array(t, copy=True) for t in times]  # when each token's chunk started through the path
    pending: dict[int, float] = {}  # record -> start time of its chunk still waiting
    while jobs:
        ready, kind, i, j = heapq.heappop(jobs)
        if kind == 0:
            start = max(ready, free_at)
            request_wait[i] = start - ready
            free_at = start + frontend.request_s
            continue
        waiting = pending.get(i)
        if waiting is not None and waiting > ready:  # its stream's last chunk has not left: ride along
            left[i][j] = waiting
            continue
        start = max(ready, free_at)
        free_at = start + frontend.chunk_s
        pending[i] = start
        left[i][j] = start
    return [_redelivered(r, times[i], left[i], request_wait[i]) for i, r in enumerate(records)]


def _redelivered(r: RequestRecord, emitted: np.ndarray, left: np.ndarray, request_wait: float) -> RequestRecord:
    """Each token later by its chunk's wait and its request's (the service itself is in
    the idle overhead already); unchanged when nothing waited."""
    if not r.ok or r.ttft_s is None or not len(emitted) or (request_wait == 0 and np.array_equal(left, emitted)):
        return r
    arrived = np.maximum.accumulate(left + request_wait)
    chunks = np.unique(arrived)  # tokens that left together are one chunk
    ttft = float(chunks[0] - r.sent_at_s)
    end = max(r.ended_at_s, float(chunks[-1]))
    return dataclasses.replace(r, ttft_s=ttft, itl_s=np.diff(chunks).tolist(), num_chunks=len(chunks),
                               ended_at_s=end, e2e_s=end - r.sent_at_s)
