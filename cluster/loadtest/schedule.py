"""Arrival schedules: offsets in seconds from the run's start, computed before it begins.

An open loop sends request i at exactly `offsets[i]` whether or not earlier requests have
finished. Precomputing the offsets (rather than gating on a semaphore) is what keeps a slow
server from turning queued requests into a burst above the target rate.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

# A bound on any schedule so a typo like `--rate 1e9 --duration 60` cannot exhaust memory.
MAX_REQUESTS = 2_000_000


def gamma_arrivals(
    rate: float, burstiness: float, seed: int, num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate; burstiness 1 is Poisson, below 1 burstier,
    above 1 more regular. The first request goes at 0. Stops at `num_requests` arrivals or
    before `duration_s`, whichever is given (both: whichever comes first)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    _check_bounds(num_requests, duration_s)
    rng = random.Random(f"schedule:{seed}")
    offsets, t = [], 0.0
    while _more(len(offsets), t, num_requests, duration_s):
        offsets.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def ramp_arrivals(
    start_rate: float, end_rate: float, seed: int, num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Poisson arrivals whose rate grows linearly from `start_rate` to `end_rate` over the
    run: unit-rate arrivals mapped through the inverse of the integrated rate. Given only a
    count, the run lasts as long as that many requests take on average."""
    if start_rate < 0 or end_rate < 0 or start_rate + end_rate == 0:
        raise ValueError("ramp rates must be >= 0 and not both 0")
    _check_bounds(num_requests, duration_s)
    span = duration_s if duration_s is not None else 2.0 * num_requests / (start_rate + end_rate)
    slope = (end_rate - start_rate) / span
    span_area = (start_rate + end_rate) * span / 2.0
    rng = random.Random(f"ramp:{seed}")
    offsets, area = [], 0.0
    while True:
        if area < span_area:
            t = _invert_linear_area(area, start_rate, slope)
        else:  # past the ramp (count-bounded runs only): hold the end rate
            t = span + (area - span_area) / end_rate if end_rate > 0 else math.inf
        if (duration_s is not None and t >= span) or not _more(len(offsets), t, num_requests, duration_s):
            return offsets
        offsets.append(t)
        area += rng.expovariate(1.0)


def _invert_linear_area(area: float, r0: float, slope: float) -> float:
    """Solve r0*t + slope*t^2/2 = area for t >= 0."""
    if abs(slope) < 1e-12:
        return area / r0
    disc = r0 * r0 + 2.0 * slope * area
    return math.inf if disc < 0 else (-r0 + math.sqrt(disc)) / slope


def trace_arrivals(path: Path) -> tuple[list[float], list[dict]]:
    """Offsets from a JSONL trace (`timestamp` in seconds, any origin; rows may carry a
    request's fields too), sorted, shifted so the first is at 0."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows or any("timestamp" not in r for r in rows):
        raise ValueError(f"{path}: every trace row needs a 'timestamp' (seconds)")
    rows.sort(key=lambda r: float(r["timestamp"]))
    first = float(rows[0]["timestamp"])
    return [float(r["timestamp"]) - first for r in rows], rows


def _check_bounds(num_requests: int | None, duration_s: float | None) -> None:
    if num_requests is None and duration_s is None:
        raise ValueError("a schedule needs num_requests or duration_s")


def _more(count: int, t: float, num_requests: int | None, duration_s: float | None) -> bool:
    if count >= MAX_REQUESTS or (num_requests is not None and count >= num_requests):
        return False
    return duration_s is None or t < duration_s
