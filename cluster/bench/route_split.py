"""How much of a cell's gap between `auto` and the best fixed configuration comes from
routing and how much from the machine.

Every repeat replays the same trace, so `auto`'s run and the best configuration's run of
the same repeat hold the same requests. Where both routed a request the same way, a
request good in one run and not in the other differs by the machine's scatter (which
cores were free, which steps it landed beside) and by what the other requests' routes
did to the replicas it ran on; where they routed it differently, the route is part of
the difference. Split that way:

- `same_route`: how many requests took the same route, and of those how many were good
  only in `auto`'s run (`auto_only`) and only in the best's (`best_only`). Their
  difference is noise around zero when the two runs put the same load on the replicas;
  its scale is about the square root of their sum.
- `other_route`: how many took different routes, and of those how many were good in
  each run (`auto_good`, `best_good`): the requests `auto` routed its own way, and how
  that went.

A cell whose gap is within one request is met whatever its split; the split says
whether a missed one is a routing fault or a gap the same routes would also show.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.loadtest.metrics import meets_slo
from cluster.local.traffic import request_class


def route_split(auto_runs: Sequence[Sequence[RequestRecord]], best_runs: Sequence[Sequence[RequestRecord]],
                slos: dict[str, SLO]) -> dict[str, dict[str, int]]:
    """Repeat by repeat (the i-th run of each replays the same trace), request by request."""
    same = {"requests": 0, "auto_only": 0, "best_only": 0}
    other = {"requests": 0, "auto_good": 0, "best_good": 0}
    for auto_records, best_records in zip(auto_runs, best_runs, strict=False):
        best_by_id = {r.request_id: r for r in best_records}
        for a in auto_records:
            b = best_by_id.get(a.request_id)
            if b is None:
                continue
            slo = slos[request_class(a.request_id)]
            good_a, good_b = meets_slo(a, slo), meets_slo(b, slo)
            if a.route is not None and a.route == b.route:
                same["requests"] += 1
                same["auto_only"] += good_a and not good_b
                same["best_only"] += good_b and not good_a
            else:
                other["requests"] += 1
                other["auto_good"] += good_a
                other["best_good"] += good_b
    return {"same_route": same, "other_route": other}


def describe(split: dict[str, dict[str, int]]) -> str:
    """One line: the routing part of the gap, then the scatter part."""
    same, other = split["same_route"], split["other_route"]
    return (f"routed differently {other['requests']} (good: auto {other['auto_good']}, best {other['best_good']}); "
            f"routed alike {same['requests']} (good in one run only: auto {same['auto_only']}, "
            f"best {same['best_only']})")
