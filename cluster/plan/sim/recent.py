"""A simulated replica's recent stream gap, as a real one reports it
(`workers/engine/recent_load.py`): over the decode-only steps of the last `WINDOW_S`,
the mean step a stream saw (weighted by streams) and the mean decode batch (weighted by
time). Steps come in groups (a run of decode-only steps is one entry), kept with running
sums so that a heartbeat costs O(1) however many steps the window holds."""

from __future__ import annotations

from collections import deque

from workers.engine.recent_load import MIN_STEPS, WINDOW_S


class RecentDecode:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._entries: deque[tuple[float, float, float, float, int]] = deque()
        self._gap_seqs = self._seqs = self._time = 0.0  # sums of duration x streams, streams x steps, duration
        self._steps = 0

    def add(self, end: float, duration_s: float, num_seqs: int, num_steps: int = 1) -> None:
        """`num_steps` decode-only steps of `num_seqs` streams, `duration_s` in all, ending at `end`."""
        entry = (end, duration_s * num_seqs, float(num_seqs * num_steps), duration_s, num_steps)
        self._entries.append(entry)
        self._gap_seqs += entry[1]
        self._seqs += entry[2]
        self._time += entry[3]
        self._steps += num_steps

    def stats(self, now: float) -> dict[str, float | int]:
        while self._entries and self._entries[0][0] < now - self.window_s:
            _, gap_seqs, seqs, time_s, steps = self._entries.popleft()
            self._gap_seqs -= gap_seqs
            self._seqs -= seqs
            self._time -= time_s
            self._steps -= steps
        if self._steps < MIN_STEPS or self._seqs <= 0 or self._time <= 0:
            return {}
        return {"recent_stream_gap_s": self._gap_seqs / self._seqs, "recent_decode_seqs": self._gap_seqs / self._time,
                "recent_decode_steps": self._steps}
