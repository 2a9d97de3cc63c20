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
