"""What a router replica says of its own predictions (`GET /admin/policy`'s
`prediction_error`): how far off, and which way."""

from __future__ import annotations

import pytest

from cluster.config import RouterSettings
from router.learning import PolicyLearner
from router.metrics import RouterMetrics


def test_the_router_reports_its_prediction_error_and_which_way_it_leans():
    """Per route: the median absolute percentage error and the median of measured /
    predicted; local predicted 100 ms three times and measured 120, 150 and 90."""
    learner = PolicyLearner(RouterSettings(), RouterMetrics("m"), "router:test")
    for measured in (0.120, 0.150, 0.090):
        learner.recent.append(("local", "ttft", 0.100, measured))
    learner.recent.append(("disagg", "tpot", 0.020, 0.010))
    errors = learner.prediction_error()
    assert errors["local"] == {"ttft_mape": pytest.approx(1 / 6, abs=1e-4), "ttft_bias": 1.2, "ttft_samples": 3}
    assert errors["disagg"] == {"tpot_mape": 1.0, "tpot_bias": 0.5, "tpot_samples": 1}


def test_a_tpot_factor_follows_a_shift_without_chasing_each_request():
    """TPOTs scattered 1.5x either way around 1.2x the prediction: after 15 samples the
    TPOT factor stays within 5% of 1.2, under a third of the swing of a TTFT factor fed
    the same outcomes; it still finds a lasting shift to 2x within 20 samples."""
    import math

    from router.corrections import Corrections, Outcome

    c = Corrections()
    tpot, ttft = [], []
    for i in range(40):
        measured = 1.2 * (1.5 if i % 2 else 1 / 1.5)
        c.observe(Outcome("local", "d1", "d1", 1.0, measured, 1.0, measured), now=float(i))
        tpot.append(c.snapshot().factor("tpot", "local", "d1", float(i)))
        ttft.append(c.snapshot().factor("ttft", "local", "d1", float(i)))
    def swing(factors: list[float]) -> float:
        return max(abs(math.log(f / 1.2)) for f in factors)

    assert swing(tpot[15:]) < math.log(1.05) and 3 * swing(tpot[30:]) < swing(ttft[30:])
    for i in range(40, 60):
        c.observe(Outcome("local", "d1", "d1", 1.0, 2.0, 1.0, 2.0), now=float(i))
    assert c.snapshot().factor("tpot", "local", "d1", 59.0) == pytest.approx(2.0, rel=0.1)
