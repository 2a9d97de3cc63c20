"""The simulated clock: a heap of timestamped callbacks, run in time order (ties in the
order they were scheduled, so a run is deterministic). An event scheduled `late` runs
after every other event of its instant: an idle engine starts its step once all the
requests arriving at that instant are in its queue."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Callback = Callable[[float], None]


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, bool, int, Callback]] = []
        self._order = itertools.count()
        self.now = 0.0
        self.num_events = 0

    def schedule(self, at: float, callback: Callback, late: bool = False) -> None:
        """Run `callback(at)` at simulated time `at` (never before now)."""
        heapq.heappush(self._heap, (max(at, self.now), late, next(self._order), callback))

    def run(self, until: Callable[[], bool]) -> None:
        """Run events in time order until `until()` holds or none are left."""
        heap, pop = self._heap, heapq.heappop
        while heap and not until():
            at, _, _, callback = pop(heap)
            self.now = at
            self.num_events += 1
            callback(at)
