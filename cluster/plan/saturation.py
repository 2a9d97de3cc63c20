"""The saturation rate of one option: the highest arrival rate at which it still meets
the SLO (`PlanPoint.meets`), found by growing or shrinking the rate geometrically (by
`factor`, 2 unless given) until it brackets the change, then bisecting the bracket to
`rel_tol`. The search only asks "does it meet at this rate?", so the same code searches
the simulator and a real deployment (`cluster/bench/plan_runs.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

REL_TOL = 0.05  # the bracket's width at the end, relative to its low end
MAX_STEPS = 8  # doublings or halvings before giving up on a bracket


class RatePoint(Protocol):
    """One run at one rate: a simulated `PlanPoint`, or a real run's figures."""

    rate: float

    @property
    def meets(self) -> bool: ...


@dataclass(frozen=True)
class Saturation:
    rate: float | None  # None: it misses the SLO even at the lowest rate tried
    points: tuple[Any, ...]  # every rate tried (RatePoints), ascending
    capped: bool = False  # still met at the highest rate tried: `rate` is a lower bound
    high: float | None = None  # the lowest rate tried that missed it (the bracket's top)


def saturation_rate(evaluate: Callable[[Any, float], RatePoint], option: Any, start_rate: float,
                    known: RatePoint | None = None, factor: float = 2.0, rel_tol: float = REL_TOL) -> Saturation:
    points: dict[float, RatePoint] = {}

    def meets(rate: float) -> bool:
        if known is not None and abs(rate - known.rate) < 1e-12:
            points[rate] = known
        if rate not in points:
            points[rate] = evaluate(option, rate)
        return points[rate].meets

    low, high = _bracket(meets, start_rate, factor)
    if low is None or high is None:
        return Saturation(low, _sorted(points), capped=low is not None, high=high)
    while (high - low) / low > rel_tol:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if meets(mid) else (low, mid)
    return Saturation(low, _sorted(points), high=high)


def _bracket(meets: Callable[[float], bool], rate: float, factor: float) -> tuple[float | None, float | None]:
    """(a rate that meets, a rate that does not), adjacent by `factor`."""
    if meets(rate):
        for _ in range(MAX_STEPS):
            if not meets(rate * factor):
                return rate, rate * factor
            rate *= factor
        return rate, None
    for _ in range(MAX_STEPS):
        if meets(rate / factor):
            return rate / factor, rate
        rate /= factor
    return None, rate


def _sorted(points: dict[float, RatePoint]) -> tuple[Any, ...]:
    return tuple(points[r] for r in sorted(points))
