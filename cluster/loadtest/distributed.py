"""`--clients K`: the plan split over K Ray actors (spread over the cluster's nodes) that
all take the same wall-clock instant as time 0, so their records merge into one run.

Client k sends requests k, k+K, k+2K, ... of the shared schedule (or, in a closed loop,
runs its share of the concurrency over those requests). Multi-node runs assume the nodes'
clocks agree (NTP), as any wall-clock start does.
"""

from __future__ import annotations

import time

from cluster.loadtest.client import Caps, RequestRecord, Target
from cluster.loadtest.runner import OnRecord, Plan

START_DELAY_S = 1.0  # between handing out the plans and time 0: room for every actor


class LoadClient:
    """One load-generating process. Async, so its requests share one event loop."""

    def ready(self) -> bool:
        import cluster.loadtest.runner  # noqa: F401  (imports done before the clock starts)

        return True

    async def run(self, plan: Plan, target: Target, caps: Caps, start_at: float, client_id: int,
                  num_clients: int) -> dict:
        from cluster.loadtest.runner import execute

        base = time.perf_counter() + (start_at - time.time())
        lags: list[float] = []
        records = await execute(plan, target, caps, base, client_id, num_clients, loop_lags_s=lags)
        return {"records": [r.to_json() for r in records], "loop_lags_s": lags}


def run_distributed(plan: Plan, target: Target, caps: Caps, num_clients: int,
                    on_record: OnRecord | None = None, loop_lags_s: list[float] | None = None) -> list[RequestRecord]:
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    actor_class = ray.remote(num_cpus=0, max_concurrency=1_000)(LoadClient)
    actors = [actor_class.options(scheduling_strategy="SPREAD").remote() for _ in range(num_clients)]
    try:
        ray.get([a.ready.remote() for a in actors])
        start_at = time.time() + START_DELAY_S
        refs = [a.run.remote(plan.for_client(k, num_clients), target, caps, start_at, k, num_clients)
                for k, a in enumerate(actors)]
        results = ray.get(refs)
        records = [RequestRecord.from_json(row) for result in results for row in result["records"]]
        if loop_lags_s is not None:
            loop_lags_s.extend(lag for result in results for lag in result["loop_lags_s"])
    finally:
        for actor in actors:
            ray.kill(actor)
    records.sort(key=lambda r: r.index)
    if on_record is not None:
        for record in records:
            on_record(record)
    return records
