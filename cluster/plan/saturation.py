"""The saturation rate of one option: the highest arrival rate at which it still meets
the SLO (`PlanPoint.meets`), found by growing or shrinking the rate geometrically until
it brackets the change, then bisecting the bracket to `REL_TOL`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.plan.evaluate import PlanPoint
from cluster.plan.options import PlanOption

REL_TOL = 0.05  # the bracket's width at the end, relative to its low end
MAX_STEPS = 8  # doublings or halvings before giving up on a bracket


@dataclass(frozen=True)
class Saturation:
    rate: float | None  # None: it misses the SLO even at the lowest rate tried
    points: tuple[PlanPoint, ...]  # every rate simulated, ascending
    capped: bool = False  # still met at the highest rate tried: `rate` is a lower bound


def saturation_rate(evaluate: Callable[[PlanOption, float], PlanPoint], option: PlanOption, start_rate: float,
                    known: PlanPoint | None = None) -> Saturation:
    points: dict[float, PlanPoint] = {}

    def meets(rate: float) -> bool:
        if known is not None and abs(rate - known.rate) < 1e-12:
            points[rate] = known
        if rate not in points:
            points[rate] = evaluate(option, rate)
        return points[rate].meets

    low, high = _bracket(meets, start_rate)
    if low is None or high is None:
        return Saturation(low, _sorted(points), capped=low is not None)
    while (high - low) / low > REL_TOL:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if meets(mid) else (low, mid)
    return Saturation(low, _sorted(points))


def _bracket(meets: Callable[[float], bool], rate: float) -> tuple[float | None, float | None]:
    """(a rate that meets, a rate that does not), adjacent by a factor of 2."""
    if meets(rate):
        for _ in range(MAX_STEPS):
            if not meets(rate * 2):
                return rate, rate * 2
            rate *= 2
        return rate, None
    for _ in range(MAX_STEPS):
        if meets(rate / 2):
            return rate / 2, rate
        rate /= 2
    return None, rate


def _sorted(points: dict[float, PlanPoint]) -> tuple[PlanPoint, ...]:
    return tuple(points[r] for r in sorted(points))
