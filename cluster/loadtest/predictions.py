"""How far the router's predictions (`x-pd-predicted-ttft-ms`, `x-pd-predicted-tpot-ms`,
made for the route it took) were from what this client measured, per route.

Per route and figure: `*_mape`, the median of |predicted − measured| / measured (a
fraction: 0.12 is 12%); `*_bias`, the median of measured / predicted (above 1: the model
is optimistic, requests take longer than it said); `*_samples`, how many requests count.
A request counts when it completed, carries a positive prediction and a positive
measurement; TPOT is the load tester's own, (E2E − TTFT) / (n − 1), so only answers of
n ≥ 2 tokens count. The TTFT compared is the client's, so it includes the HTTP hop the
router's prediction leaves out: a small bias above 1 is expected. Routes and figures with
no samples are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import median

from cluster.loadtest.client import RequestRecord

FIGURES = ("ttft", "tpot")


def prediction_error(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """`{route: {ttft_mape, ttft_bias, ttft_samples, tpot_mape, tpot_bias, tpot_samples}}`."""
    by_route: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.ok and r.route:
            by_route.setdefault(r.route, []).append(r)
    result = {}
    for route, route_records in sorted(by_route.items()):
        block = {}
        for figure in FIGURES:
            pairs = [(getattr(r, f"predicted_{figure}_s"), getattr(r, f"{figure}_s")) for r in route_records]
            block.update(_errors(figure, pairs))
        if block:
            result[route] = block
    return result


def _errors(figure: str, pairs: Iterable[tuple[float | None, float | None]]) -> dict:
    pairs = [(p, m) for p, m in pairs if p is not None and m is not None and p > 0 and m > 0]
    if not pairs:
        return {}
    return {
        f"{figure}_mape": round(median(abs(p - m) / m for p, m in pairs), 6),
        f"{figure}_bias": round(median(m / p for p, m in pairs), 6),
        f"{figure}_samples": len(pairs),
    }
