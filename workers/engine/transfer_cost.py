"""KV transfer time per (prefill, decode) pair, learned from transfer samples.

    seconds = fixed_s + bytes / bytes_per_s

Fitted like the step model (`cost_model`): over a sliding window of (bytes, seconds)
samples, minimising the relative error sum(((pred - s) / s)^2) with fixed_s >= 0 and
1 / bytes_per_s >= 0. A pair never seen predicts from the pooled fit over all pairs,
and with no samples at all from `DEFAULT_TRANSFER`. `TransferTails` is a prefill
replica's: it learns from its sender's `TransferRecord`s.

A fit may forget samples older than `max_age_s`: a link measured slow a minute ago and
not used since is predicted from the default again, so a router that stopped sending
transfers over it because it was slow tries it again instead of avoiding it forever.

A link that changes (a congested NIC, a degraded path, the fault injection's delay) shows
as samples the fit misses the same way: when `CHANGE_RUN` samples in a row each sit more
than `CHANGE_RATIO` times (and `CHANGE_MIN_S`) off the prediction of a fit of at least
`CHANGE_RUN` samples on the same side, the older samples are dropped and the fit restarts
from those, so it follows the change within a few transfers instead of averaging it
against a window of the old link. A link that stalls for whole seconds (`BIG_CHANGE_*`:
each miss `BIG_CHANGE_RATIO` times and `BIG_CHANGE_MIN_S` off) is followed after
`BIG_CHANGE_RUN`: every transfer it carries meanwhile is a remote request late by as
much. Where a fit had to hold six samples first and a run of three, a live app whose
link began holding each KV layer 0.4 s (64-token prompts, one every 3 s, four before)
priced the first four slowed prompts at 21-42 ms against 830 measured; now the third
on is priced at 0.82 s.

The pooled fit (for a decode peer this replica never sent to) is over the pairs' windows
as they stand: when a pair's fit restarts, the pooled one is rebuilt from every pair's
samples, so the old link's samples leave it too. Fed every sample and never restarted
(its links differ, so a change cannot be told from a mix of peers), it priced a decode
replica that joined after a link slowed from the window of the link as it had been.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from workers.engine.nnls_fit import nnls_relative

WINDOW = 512
TAIL_MAX_AGE_S = 60.0  # a prefill replica's tail samples are forgotten after this
MIN_FULL_FIT = 4  # fewer samples, or one size only: bandwidth with the default fixed cost
CHANGE_RUN = 3  # this many samples in a row, each ...
CHANGE_RATIO = 2.0  # ... this many times off the prediction on the same side, and ...
CHANGE_MIN_S = 0.005  # ... this far in seconds: the link changed, refit from them alone
BIG_CHANGE_RUN = 2  # this many in a row, each ...
BIG_CHANGE_RATIO = 8.0  # ... this many times off on the same side, and ...
BIG_CHANGE_MIN_S = 0.1  # ... this far: refit from them alone


@dataclass(frozen=True)
class TransferCoefficients:
    fixed_s: float
    bytes_per_s: float  # inf when the fit puts no cost on bytes
    num_samples: int = 0

    def to_dict(self) -> dict[str, float | int | None]:
        data = asdict(self)
        data["bytes_per_s"] = None if np.isinf(self.bytes_per_s) else self.bytes_per_s
        return data

    @classmethod
    def from_dict(cls, data: dict) -> TransferCoefficients:
        bandwidth = data["bytes_per_s"]
        return cls(data["fixed_s"], float("inf") if bandwidth is None else bandwidth,
                   data.get("num_samples", 0))


# A cold pair: 2 ms of setup and 1 GB/s (a TCP path); the first samples replace it.
DEFAULT_TRANSFER = TransferCoefficients(0.002, 1e9)


class TransferCostFit:
    """Online fit of fixed + bytes / bandwidth over the last `window` samples."""

    def __init__(self, window: int = WINDOW, default: TransferCoefficients = DEFAULT_TRANSFER,
                 max_age_s: float | None = None, follow_changes: bool = True) -> None:
        self._follow_changes = follow_changes  # off for a fit pooled over links that differ
        self._bytes: deque[float] = deque(maxlen=window)
        self._seconds: deque[float] = deque(maxlen=window)
        self._at: deque[float] = deque(maxlen=window)  # time.time() of each sample
        self._default = default
        self._prior = default  # what a fit of too few samples keeps the bandwidth of
        self._coefficients = default
        self._max_age_s = max_age_s
        self._stale = False
        # the side the last samples missed on (+1 / -1; 0: none), how many, and whether
        # each of them missed by a `BIG_CHANGE_*` margin
        self._run: tuple[int, int, bool] = (0, 0, False)

    @property
    def coefficients(self) -> TransferCoefficients:
        self._expire(time.time())
        if self._stale:
            self.fit()
        return self._coefficients

    def observe(self, num_bytes: float, seconds: float, at: float | None = None) -> bool:
        """Learn one sample; True when it restarted the fit (the link changed)."""
        if not (seconds > 0 and num_bytes >= 0):
            return False
        established = self._follow_changes and len(self._seconds) >= CHANGE_RUN
        predicted = self.predict(num_bytes) if established else 0.0
        side = _miss_side(predicted, seconds) if established else 0
        big = side != 0 and _miss_side(predicted, seconds, BIG_CHANGE_RATIO, BIG_CHANGE_MIN_S) == side
        self._bytes.append(float(num_bytes))
        self._seconds.append(float(seconds))
        self._at.append(time.time() if at is None else at)
        self._stale = True
        return self._track_change(side, big)

    def samples(self) -> list[tuple[float, float, float]]:
        """(at, bytes, seconds) of the samples in the window, oldest first."""
        self._expire(time.time())
        return list(zip(self._at, self._bytes, self._seconds, strict=True))

    def refill(self, samples: Iterable[tuple[float, float, float]]) -> None:
        """Start over from `samples` ((at, bytes, seconds), oldest first), keeping the
        bandwidth fitted so far as the prior until sizes tell the terms apart."""
        self._prior = self.coefficients
        for window in (self._at, self._bytes, self._seconds):
            window.clear()
        for at, num_bytes, seconds in samples:
            self._at.append(at)
            self._bytes.append(num_bytes)
            self._seconds.append(seconds)
        self._run = (0, 0, False)
        self._stale = True

    def _track_change(self, side: int, big: bool) -> bool:
        if not side:
            self._run = (0, 0, False)
            return False
        last, count, all_big = self._run
        count, all_big = (count + 1, all_big and big) if side == last else (1, big)
        self._run = (side, count, all_big)
        keep = count if count >= CHANGE_RUN or (all_big and count >= BIG_CHANGE_RUN) else 0
        if not keep or len(self._seconds) <= keep:
            return False
        for samples in (self._bytes, self._seconds, self._at):
            for _ in range(len(samples) - keep):
                samples.popleft()
        self._run = (0, 0, False)
        self._prior = self._coefficients  # the old link's bandwidth until sizes tell them apart
        return True

    def _expire(self, now: float) -> None:
        if self._max_age_s is None:
            return
        while self._at and self._at[0] < now - self._max_age_s:
            self._at.popleft()
            self._bytes.popleft()
            self._seconds.popleft()
            self._stale = True

    def fit(self) -> TransferCoefficients:
        self._stale = False
        if self._seconds:
            self._coefficients = fit_transfer(np.array(self._bytes), np.array(self._seconds), self._prior)
        else:
            self._coefficients = self._prior = self._default  # every sample aged out
        return self._coefficients

    def predict(self, num_bytes: float) -> float:
        """Predicted transfer seconds for `num_bytes`."""
        c = self.coefficients
        return c.fixed_s + num_bytes / c.bytes_per_s


def stalled(predicted: float, seconds: float) -> bool:
    """A transfer that took `seconds` against `predicted` stalled: over `BIG_CHANGE_RATIO`
    times and `BIG_CHANGE_MIN_S` slower (what restarts a fit after `BIG_CHANGE_RUN`)."""
    return _miss_side(predicted, seconds, BIG_CHANGE_RATIO, BIG_CHANGE_MIN_S) == 1


def _miss_side(predicted: float, seconds: float, ratio: float = CHANGE_RATIO, min_s: float = CHANGE_MIN_S) -> int:
    """+1 / -1 when `seconds` is above / below `predicted` by `ratio` times and `min_s`, else 0."""
    if seconds > ratio * predicted and seconds - predicted > min_s:
        return 1
    if seconds * ratio < predicted and predicted - seconds > min_s:
        return -1
    return 0


def fit_transfer(num_bytes: np.ndarray, seconds: np.ndarray,
                 prior: TransferCoefficients) -> TransferCoefficients:
    """NNLS on relative error; with too few samples or a single size the two terms cannot
    be told apart, so the prior's bandwidth (the default's, or the link's before it
    changed) is kept and only the fixed cost is fitted."""
    if len(seconds) >= MIN_FULL_FIT and np.ptp(num_bytes) > 0:
        fixed, per_byte = nnls_relative(np.stack([np.ones_like(num_bytes), num_bytes], axis=1), seconds)
    else:
        per_byte = 1.0 / prior.bytes_per_s
        fixed = max(0.0, float(np.median(seconds - num_bytes * per_byte)))
    bandwidth = float("inf") if per_byte <= 0 else 1.0 / per_byte
    return TransferCoefficients(float(fixed), bandwidth, len(seconds))


class TransferCosts:
    """Transfer fits keyed by (prefill, decode) replica pair, plus the pooled fit."""

    def __init__(self, window: int = WINDOW, default: TransferCoefficients = DEFAULT_TRANSFER,
                 max_age_s: float | None = None) -> None:
        self._window, self._default, self._max_age_s = window, default, max_age_s
        # per pair: a change of the link restarts its fit; the pooled fit mixes links
        self._pairs: dict[tuple[str, str], TransferCostFit] = {}
        self._pooled = TransferCostFit(window, default, max_age_s, follow_changes=False)

    def observe(self, prefill_id: str, decode_id: str, num_bytes: float, seconds: float,
                at: float | None = None) -> None:
        pair = (prefill_id, decode_id)
        if pair not in self._pairs:
            self._pairs[pair] = TransferCostFit(self._window, self._default, self._max_age_s)
        if self._pairs[pair].observe(num_bytes, seconds, at):  # the link changed: so did the pool
            self._pooled.refill(sorted(s for fit in self._pairs.values() for s in fit.samples()))
        else:
            self._pooled.observe(num_bytes, seconds, at)

    def fit_for(self, prefill_id: str, decode_id: str) -> TransferCostFit:
        """The pair's own fit; the pooled one for a pair never seen."""
        return self._pairs.get((prefill_id, decode_id), self._pooled)

    def predict(self, prefill_id: str, decode_id: str, num_bytes: float) -> float:
        return self.fit_for(prefill_id, decode_id).predict(num_bytes)

    def coefficients(self) -> dict[str, TransferCoefficients]:
        """Per pair as "prefill->decode", plus "*" for the pooled fit."""
        out = {f"{p}->{d}": fit.coefficients for (p, d), fit in self._pairs.items()}
        out["*"] = self._pooled.coefficients
        return out

    def coefficients_from(self, prefill_id: str) -> dict[str, TransferCoefficients]:
        """`prefill_id`'s pairs keyed by decode id, plus "*" for the pooled fit (all of
        its pairs when, as on a prefill replica, every sample is from `prefill_id`)."""
        out = {d: fit.coefficients for (p, d), fit in self._pairs.items() if p == prefill_id}
        out["*"] = self._pooled.coefficients
        return out


class TransferTails:
    """A prefill replica's transfer cost per decode peer address, fitted on each transfer's
    exposed tail (`TransferRecord.tail_seconds`: what it adds to time to first token).

    `learn` takes the sender's whole record deque and feeds only the records it has not
    seen, so the transfer path keeps no hook and the replica learns when it reports."""

    def __init__(self, prefill_id: str, window: int = WINDOW, max_age_s: float | None = TAIL_MAX_AGE_S) -> None:
        self.prefill_id = prefill_id
        self.costs = TransferCosts(window, max_age_s=max_age_s)
        self._last = None  # the newest record fed

    def learn(self, records: Iterable) -> int:
        """Feed the records after the last one fed; returns how many."""
        new = records_after(records, self._last)
        for r in new:
            self.costs.observe(self.prefill_id, r.peer, r.num_bytes, r.tail_seconds, r.ended_at)
        if new:
            self._last = new[-1]
        return len(new)

    def to_dict(self) -> dict[str, dict]:
        """{peer address: `TransferCoefficients.to_dict()`, ..., "*": the fit over all peers}."""
        return {peer: c.to_dict() for peer, c in self.costs.coefficients_from(self.prefill_id).items()}


def records_after(records: Iterable, last) -> list:
    """The records newer than `last`, all of them when `last` is None or already evicted:
    a bounded deque that is only appended to holds them after `last`'s place."""
    snapshot = list(records)  # one atomic copy: the sender's threads append meanwhile
    for i in range(len(snapshot) - 1, -1, -1):
        if snapshot[i] is last:
            return snapshot[i + 1:]
    return snapshot
