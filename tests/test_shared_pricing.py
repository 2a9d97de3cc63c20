"""A request's candidates share what they read alike of its decode replica (its queue and
steps, the streams' objective and untouched gap), priced once for all of them: each
scores exactly as it does priced on its own."""

from __future__ import annotations

import pytest

from cluster.config import SLO
from router import predict
from router.auto_policy import candidates, corrected, score
from router.corrections import Outcome
from tests.test_auto_policy import BUSY_STREAMS, TABLE, _measured, ctx, replica

HOST_STREAMS = {"num_streams": 2, "stream_context": 2 * 300, "stream_tokens_left": 20.0, "recent_gap_s": 0.02}
BOTH_DECODE = ctx(decode=replica("d1", recent_gap_s=0.012, **BUSY_STREAMS), slo=SLO(ttft_ms=2000, tpot_ms=14),
                  prefills=(replica("p1", "prefill", **HOST_STREAMS), replica("p2", "prefill", queue_tokens=900)),
                  whole=replica("p1", "prefill", **HOST_STREAMS), whole_cached_tokens=0)


@pytest.mark.parametrize("name, context", [(row[0], row[1]) for row in TABLE]
                         + [("streams on the decode replica and on the one a request may run whole", BOTH_DECODE)])
def test_pricing_once_per_request_changes_no_score(name, context):
    """Every candidate scores as it does alone; a remote one is priced as without the
    shared decode side. A wrong key (the untouched gap kept for whichever replica came
    first) fails the last context, whose whole candidate decodes beside other streams."""
    state = _measured("local", 5.0)
    state.observe(Outcome("disagg", "p1", "d1", 0.1, 0.13, 0.01, 0.012), 5.0)
    snapshot, shared = state.snapshot(), {}
    for c in candidates(context):
        prediction = corrected(c, snapshot, 5.0)
        assert score(context, c, prediction, snapshot, 5.0, shared) == score(context, c, prediction, snapshot, 5.0)
        if c.kind == "remote":
            p = next(p for p in context.prefills if p.replica_id == c.prefill_replica)
            assert predict.remote(context.shape, p, context.decode, 0, 0) == c  # without the shared decode side
    assert shared or not context.decode.num_streams
