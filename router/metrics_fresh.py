"""Wait until every source's metrics on the control plane are newer than a moment.

Engine replicas send their metrics with each heartbeat and routers every few seconds,
so `/metrics` can trail what already happened by about one interval. A reader that
brackets a window (a load test's first and last sample, `pdcluster doctor`) asks for
`/metrics?fresh=true`: the answer then holds everything observed before it was asked.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

FRESH_WAIT_S = 3.0  # beyond this a silent source is left as it is (its heartbeat is failing)
POLL_S = 0.05


async def wait_fresh(control_plane: Any, push_own: Any, timeout_s: float = FRESH_WAIT_S) -> list[str]:
    """Await `push_own()` (this router's snapshot) and then every other source's next
    push; the sources still behind when `timeout_s` ends, none when all caught up."""
    since = await control_plane.now.remote()
    await push_own()
    deadline = time.monotonic() + timeout_s
    while True:
        stale = await control_plane.stale_sources.remote(since)
        if not stale or time.monotonic() >= deadline:
            return stale
        await asyncio.sleep(POLL_S)
