"""How fast requests arrive to decode on each replica, and prompt tokens to be computed
there, as this router placed them.

A prompt prefilled beside a replica's streams slows every step there while its chunks
run, and not only for the streams decoding now: the requests placed there meanwhile
decode beside it too. A background prefill is the case that matters: its small chunk
keeps the streams of the moment inside their objective, but it runs for seconds. In
`bench cluster`'s balanced cell a 1,496-token prompt whose every route met the objectives
went to the background (4.2-4.6 s) beside six streams; short requests kept arriving at
4/s, decoded beside its chunks at 70-90 ms a token against 63, and two repeats of three
lost a third of their requests to it. `router/auto_policy.py` counts the streams
expected to join while a candidate slows the decode replica in its risk.

The other way round, a stream slows down where prompts keep arriving: a request run whole
on an idle prefill replica decodes there beside the remote prefills sent after it, each a
few full-budget chunks. In `bench cluster`'s load-shift run a 1,476-token request placed
so, predicted at 20 ms a token, decoded at 144 beside one 2,002-token remote prefill;
`router/predict.py` prices a stream's gap with the share of the replica's time that the
prompts arriving at their recent pace take.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0
MAX_KEPT = 512  # placements kept per replica: 50/s over the window


class ArrivalRate:
    """Per replica, the placements of the last `window_s` and their weights (1 each by
    default: requests; prompt tokens where the caller weighs them so)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._times: dict[str, deque[tuple[float, float]]] = {}
        self._sums: dict[str, float] = {}

    def add(self, replica_id: str, at: float, weight: float = 1.0) -> None:
        """A placement at `at` (the policy's clock) on `replica_id`."""
        times = self._times.setdefault(replica_id, deque())
        if len(times) == MAX_KEPT:
            self._sums[replica_id] -= times.popleft()[1]
        times.append((at, weight))
        self._sums[replica_id] = self._sums.get(replica_id, 0.0) + weight

    def rate(self, replica_id: str, now: float) -> float:
        """Weight per second placed there over the last `window_s`."""
        times = self._times.get(replica_id)
        if not times:
            return 0.0
        total = self._sums[replica_id]
        while times and times[0][0] < now - self.window_s:
            total -= times.popleft()[1]
        self._sums[replica_id] = total if times else 0.0
        return max(total, 0.0) / self.window_s

    def forget(self, replica_ids: set[str]) -> None:
        """Drop the replicas not in `replica_ids` (gone from the cluster)."""
        for gone in set(self._times) - replica_ids:
            del self._times[gone]
            self._sums.pop(gone, None)
