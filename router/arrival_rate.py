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
`router/replica_steps.py` prices a stream's gap with the share of the replica's time that the
prompts arriving at their recent pace take.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0
MAX_KEPT = 512  # placements kept per replica: 50/s over the window


class ArrivalRate:
    """Per replica, the placements of the last `window_s`, each with `num_weights` weights
    (1 each by default: requests; prompt tokens and their work where the caller weighs
    them so) and an optional tag that is counted, never summed (a request's TTFT
    objective), and each weight's sum and each tag's count, kept as placements come and
    leave the window."""

    def __init__(self, window_s: float = WINDOW_S, num_weights: int = 1) -> None:
        self.window_s, self.num_weights = window_s, num_weights
        self._entries: dict[str, deque[tuple[float, tuple[float, ...], float | None]]] = {}  # oldest first
        self._sums: dict[str, list[float]] = {}
        self._tags: dict[str, dict[float, int]] = {}  # per replica, placements in the window per tag

    def add(self, replica_id: str, at: float, *weights: float, tag: float | None = None) -> None:
        """A placement at `at` (the policy's clock) on `replica_id`; no weights: 1 each."""
        weights = weights or (1.0,) * self.num_weights
        if len(weights) != self.num_weights:
            raise ValueError(f"expected {self.num_weights} weights, got {len(weights)}")
        entries = self._entries.setdefault(replica_id, deque())
        sums = self._sums.setdefault(replica_id, [0.0] * self.num_weights)
        tags = self._tags.setdefault(replica_id, {})
        if len(entries) == MAX_KEPT:
            _drop(entries.popleft(), sums, tags)
        entries.append((at, weights, tag))
        for i, w in enumerate(weights):
            sums[i] += w
        if tag is not None:
            tags[tag] = tags.get(tag, 0) + 1

    def rates(self, replica_id: str, now: float) -> tuple[float, ...]:
        """Each weight per second placed there over the last `window_s`."""
        if not self._prune(replica_id, now):
            return (0.0,) * self.num_weights
        window = self.window_s
        return tuple([total / window if total > 0.0 else 0.0 for total in self._sums[replica_id]])

    def count_rate(self, replica_id: str, now: float) -> float:
        """Placements on `replica_id` per second over the last `window_s`, whatever their weights."""
        return len(self._prune(replica_id, now)) / self.window_s

    def recent(self, replica_id: str, now: float) -> tuple[tuple[float, ...], ...]:
        """The weights of each placement on `replica_id` over the last `window_s`, oldest first."""
        return tuple([entry[1] for entry in self._prune(replica_id, now)])

    def tag_counts(self, replica_id: str, now: float) -> tuple[tuple[float, int], ...]:
        """(tag, how many placements on `replica_id` over the last `window_s` have it),
        ascending by tag. Counted as placements come and go, not per read: the decode
        replica's arrivals are read for every request, at 50 a second there as many as
        500 of them."""
        if not self._prune(replica_id, now):
            return ()
        return tuple(sorted(self._tags[replica_id].items()))

    def _prune(self, replica_id: str, now: float) -> deque[tuple[float, tuple[float, ...], float | None]]:
        """The replica's placements still in the window (empty: none), the rest dropped."""
        entries = self._entries.get(replica_id)
        if not entries:
            return deque()
        sums, tags = self._sums[replica_id], self._tags[replica_id]
        cutoff = now - self.window_s
        while entries and entries[0][0] < cutoff:
            _drop(entries.popleft(), sums, tags)
        if not entries:
            sums[:] = [0.0] * self.num_weights  # no drift from float sums once empty
        return entries

    def rate(self, replica_id: str, now: float) -> float:
        """The first weight per second (requests per second, unweighted)."""
        return self.rates(replica_id, now)[0]

    def forget(self, replica_ids: set[str]) -> None:
        """Drop the replicas not in `replica_ids` (gone from the cluster)."""
        for gone in set(self._entries) - replica_ids:
            del self._entries[gone]
            self._sums.pop(gone, None)
            self._tags.pop(gone, None)


def _drop(entry: tuple[float, tuple[float, ...], float | None], sums: list[float],
          tags: dict[float, int]) -> None:
    for i, w in enumerate(entry[1]):
        sums[i] -= w
    tag = entry[2]
    if tag is not None:
        left = tags[tag] - 1
        if left:
            tags[tag] = left
        else:
            del tags[tag]
