"""The prompts that arrived lately for each replica's foreground lane, and the TTFT slack
each had: what a long prompt placed in that lane now would make late.

A replica's foreground prompts run in arrival order (`router/queue_drain.py`), so one
that takes `hold` seconds of chunks delays every prompt arriving behind it by what is
left of that time. Arrivals like those of the last `WINDOW_S` seconds (rate n / W, each
with the slack it had: its TTFT objective less its predicted TTFT) come uniformly
during the hold; one with slack `s` that arrives `t` into it is late when `hold - t > s`.
So the expected number made late is `sum over recent arrivals of max(0, hold - s) / W`
(`late_arrivals`). In `bench cluster`'s `tight_ttft` cell (short prompts arriving at
4/s with 85 ms of slack), a 1,496-token prompt prefilled in the foreground of the decode
replica (every route met its own objective; that one was quickest) made the next seven
short requests late.

Plain data, no clock of its own: the caller passes the policy's.
"""

from __future__ import annotations

import bisect
from collections import deque

WINDOW_S = 10.0
MAX_PER_REPLICA = 256  # a replica's arrivals kept: enough for 25/s over the window


class RecentArrivals:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._by_replica: dict[str, deque[tuple[float, float]]] = {}
        self._sorted: dict[str, tuple[float, ...]] = {}  # per replica, until its arrivals change

    def add(self, replica_id: str, at: float, slack_s: float) -> None:
        """A prompt placed in `replica_id`'s foreground lane at `at`, `slack_s` to spare."""
        arrivals = self._by_replica.setdefault(replica_id, deque(maxlen=MAX_PER_REPLICA))
        arrivals.append((at, max(0.0, slack_s)))
        self._sorted.pop(replica_id, None)

    def slacks(self, replica_id: str, now: float) -> tuple[float, ...]:
        """The slacks of the arrivals of the last `window_s` there, ascending."""
        arrivals = self._by_replica.get(replica_id)
        if not arrivals:
            return ()
        if arrivals[0][0] < now - self.window_s:
            while arrivals and arrivals[0][0] < now - self.window_s:
                arrivals.popleft()
            self._sorted.pop(replica_id, None)
        cached = self._sorted.get(replica_id)
        if cached is None:
            cached = self._sorted[replica_id] = tuple(sorted(s for _, s in arrivals))
        return cached

    def forget(self, replica_ids: set[str]) -> None:
        """Drop the replicas not in `replica_ids` (gone from the cluster)."""
        for gone in set(self._by_replica) - replica_ids:
            del self._by_replica[gone]
            self._sorted.pop(gone, None)


def late_arrivals(slacks: tuple[float, ...], window_s: float, hold_s: float) -> float:
    """The arrivals expected late behind `hold_s` seconds of foreground chunks, from the
    recent ones' ascending `slacks` over `window_s`."""
    if hold_s <= 0 or not slacks or window_s <= 0:
        return 0.0
    k = bisect.bisect_left(slacks, hold_s)
    return (k * hold_s - sum(slacks[:k])) / window_s
