"""How late a replica's prefills are running: evidence before the requests finish.

A request still waiting for its first token past its predicted TTFT says the path it
took is slower than the model thinks (a slowed link, a stuck replica) while it is still
waiting, not only once it completes. Per route, the oldest request waiting on a replica's
prefill gives a ratio of its wait to its prediction, which `auto` reads as a correction
(`ReplicaLoad.overdue`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.placement import Placement

OVERDUE_MARGIN_S = 0.05  # a first token this late past its prediction is jitter, not evidence
MAX_OVERDUE = 8.0  # as a correction: one request counts as at most this ratio


def overdue(waiting: Mapping[tuple[str, str], deque[Placement]], replica_id: str, now: float) -> dict[str, float]:
    """Per route: the oldest request of `waiting` ((route, replica that prefills) ->
    placements waiting for their first token, oldest first) on `replica_id`, its wait
    over its predicted TTFT (plus `OVERDUE_MARGIN_S`), where above 1."""
    out = {}
    for route in ("local", "disagg"):
        queue = waiting.get((route, replica_id))
        if not queue:
            continue
        oldest = queue[0]
        late = (now - oldest.placed_at) / (oldest.decision.prediction.ttft_s + OVERDUE_MARGIN_S)
        if late > 1.0:
            out[route] = min(late, MAX_OVERDUE)
    return out
