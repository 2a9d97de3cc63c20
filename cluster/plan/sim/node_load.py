"""A simulated node's decode rate: the decode sequence-steps its engines ran over the
last `NODE_RATE_WINDOW_S`, a second, as `cluster/plan/records.py` computes it from a
real node's step records. The step model's stream term (`node_stream_contention`)
prices the serving path's share of the node's cores from it.

Steps are added when they end (a run of decode-only steps as one entry), kept with a
running sum, so a read costs O(1) amortised however many steps the window holds."""

from __future__ import annotations

from collections import deque

from workers.engine.cost_model import NODE_RATE_WINDOW_S


class NodeStreams:
    def __init__(self, window_s: float = NODE_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._entries: deque[tuple[float, int]] = deque()
        self._sum = 0

    def add(self, at: float, sequence_steps: int) -> None:
        if sequence_steps:
            self._entries.append((at, sequence_steps))
            self._sum += sequence_steps

    def rate(self, now: float) -> float:
        while self._entries and self._entries[0][0] < now - self.window_s:
            self._sum -= self._entries.popleft()[1]
        return self._sum / self.window_s
