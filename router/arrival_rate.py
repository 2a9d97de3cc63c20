"""How fast requests arrive to decode on each replica, as this router placed them.

A prompt prefilled beside a replica's streams slows every step there while its chunks
run, and not only for the streams decoding now: the requests placed there meanwhile
decode beside it too. A background prefill is the case that matters: its small chunk
keeps the streams of the moment inside their objective, but it runs for seconds. In
`bench cluster`'s balanced cell a 1,496-token prompt whose every route met the objectives
went to the background (4.2-4.6 s) beside six streams; short requests kept arriving at
4/s, decoded beside its chunks at 70-90 ms a token against 63, and two repeats of three
lost a third of their requests to it. `router/auto_policy.py` counts the streams
expected to join while a candidate slows the decode replica in its risk.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0
MAX_KEPT = 512  # placements kept per replica: 50/s over the window


class ArrivalRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._times: dict[str, deque[float]] = {}

    def add(self, replica_id: str, at: float) -> None:
        """A request placed at `at` (the policy's clock) to decode on `replica_id`."""
        self._times.setdefault(replica_id, deque(maxlen=MAX_KEPT)).append(at)

    def rate(self, replica_id: str, now: float) -> float:
        """Requests per second placed to decode there over the last `window_s`."""
        times = self._times.get(replica_id)
        if not times:
            return 0.0
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times) / self.window_s

    def forget(self, replica_ids: set[str]) -> None:
        """Drop the replicas not in `replica_ids` (gone from the cluster)."""
        for gone in set(self._times) - replica_ids:
            del self._times[gone]
