"""The cluster's metrics for `/metrics`, optionally holding everything observed so far.

Engine replicas send their metrics with each heartbeat and routers every few seconds,
so `/metrics` can trail what already happened by about one interval. A reader that
brackets a window (a load test's first and last sample, `pdcluster doctor`) asks for
`/metrics?fresh=true`: the answer then waits for every source's next push and holds
everything observed before it was asked.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

FRESH_WAIT_S = 3.0  # beyond this a silent source is left as it is (its heartbeat is failing)
POLL_S = 0.05


async def cluster_metrics(control_plane: Any, source_id: str, own: Any, fresh: bool = False,
                          timeout_s: float = FRESH_WAIT_S) -> tuple[bytes, dict[str, str]]:
    """Push this router's `own` snapshot, then render every source's; with `fresh`, first
    wait (at most `timeout_s`) until each other source has pushed since, and say in
    header `x-pdc-stale-sources` how many had not."""
    since = await control_plane.now.remote() if fresh else 0.0
    await control_plane.push_metrics.remote(source_id, own)
    headers = {}
    if fresh:
        stale = await _wait_for_pushes(control_plane, since, timeout_s)
        headers["x-pdc-stale-sources"] = str(len(stale))
    return await control_plane.render_metrics.remote(), headers


async def _wait_for_pushes(control_plane: Any, since: float, timeout_s: float) -> list[str]:
    """The sources still behind `since` when all caught up (none) or `timeout_s` ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        stale = await control_plane.stale_sources.remote(since)
        if not stale or time.monotonic() >= deadline:
            return stale
        await asyncio.sleep(POLL_S)
