"""What the router saw of one benchmark run: its decision log cut to the run, and the
run's TTFT as the router and the called worker measured it.

Three TTFTs of one request nest: the client's (the load tester: send to first chunk)
holds the router's (arrival to first token), which holds the worker's (its call to its
first token, `GenerateChunk.worker_ttft_s`). Between two configurations that route the
same way, a client TTFT gap with equal worker TTFTs is the path, not the route.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def run_decisions(log: dict, started_at: float) -> dict:
    """`GET /admin/decisions`' answer cut to the decisions made from `started_at` (Unix
    seconds) on: one run's, with the load tester's probe request."""
    return {**log, "decisions": [d for d in log.get("decisions", []) if d.get("at", 0.0) >= started_at]}


def router_side_figures(decisions: list[dict], request_ids: Iterable[str]) -> dict[str, float | None]:
    """The median router-side and worker TTFT (ms) of the run's requests (`request_ids`,
    as the load tester named them: the router's ids carry the run's prefix before them),
    and how many of them the log held (a run of more requests than
    `decision_log.DECISION_LOG_SIZE` keeps its last ones)."""
    wanted = set(request_ids)
    mine = [d for d in decisions if _origin(d.get("request_id", "")) in wanted]
    return {"router_ttft_p50_ms": _median(d.get("measured_ttft_ms") for d in mine),
            "worker_ttft_p50_ms": _median(d.get("worker_ttft_ms") for d in mine),
            "num_logged": len(mine)}


def _origin(router_id: str) -> str:
    """The load tester's id of a request: the router's id less the run prefix (`<hex>-`)."""
    return router_id.split("-", 1)[1] if "-" in router_id else router_id


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 4) if kept else None
