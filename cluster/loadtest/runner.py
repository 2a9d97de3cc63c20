"""Drive the requests of a plan: an open loop from precomputed arrival times, or a closed
loop of `concurrency` workers. Both stop starting requests at the bound (count or
duration) and then drain: every request in flight finishes and is counted."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from cluster.loadtest.client import Caps, ClientShards, RequestRecord, Target, send_request
from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.prompt_blocks import salted
from cluster.loadtest.schedule import gamma_arrivals, ramp_arrivals, trace_arrivals
from cluster.loadtest.workloads import RequestSpec, iter_workload, request_from_row

OnRecord = Callable[[RequestRecord], None]


@dataclass
class Plan:
    """What to send. Open loop: `specs[i]` at `offsets[i]` seconds. Closed loop
    (`offsets` None): `concurrency` workers take requests in order from the workload, at
    most `num_requests`, none starting after `duration_s`."""

    workload: str
    seed: int
    specs: list[RequestSpec] | None = None
    offsets: list[float] | None = None
    concurrency: int = 1
    num_requests: int | None = None
    duration_s: float | None = None
    target_rate: float | None = None
    salt: str | None = None  # `prompt_blocks.salted` on every request

    def requests(self) -> Iterator[RequestSpec]:
        """The workload's endless request stream, salted as this plan says."""
        stream = iter_workload(self.workload, self.seed)
        return (salted(spec, self.salt) for spec in stream) if self.salt else stream

    @property
    def is_open_loop(self) -> bool:
        return self.offsets is not None

    def for_client(self, client_id: int, num_clients: int) -> Plan:
        """Client k of K takes every K-th request (and its share of the concurrency)."""
        if num_clients == 1:
            return self
        if self.is_open_loop:
            return replace(self, specs=self.specs[client_id::num_clients], offsets=self.offsets[client_id::num_clients])
        share = self.concurrency // num_clients + (client_id < self.concurrency % num_clients)
        return replace(self, concurrency=max(share, 1))


def build_plan(config: LoadTestConfig) -> Plan:
    n, duration = config.effective_num_requests, config.duration_s
    if config.rate is not None:
        offsets = gamma_arrivals(config.rate, config.burstiness, config.seed, n, duration)
        return _open(config, offsets, config.rate)
    if config.ramp is not None:
        offsets = ramp_arrivals(config.ramp[0], config.ramp[1], config.seed, n, duration)
        return _open(config, offsets, None)
    if config.trace is not None:
        return _trace_plan(config)
    return Plan(config.workload, config.seed, concurrency=config.concurrency or 1, num_requests=n, duration_s=duration,
                salt=config.prompt_salt)


def _open(config: LoadTestConfig, offsets: list[float], rate: float | None) -> Plan:
    plan = Plan(config.workload, config.seed, target_rate=rate, salt=config.prompt_salt)
    return replace(plan, specs=list(itertools.islice(plan.requests(), len(offsets))), offsets=offsets)


def _trace_plan(config: LoadTestConfig) -> Plan:
    """Rows that carry a request (`prompt`, `messages` or `prompt_len`) use it; others take
    the next request of `--workload`."""
    offsets, rows = trace_arrivals(config.trace)
    limit = len(offsets)
    if config.num_requests is not None:
        limit = min(limit, config.num_requests)
    if config.duration_s is not None:
        limit = sum(1 for t in offsets[:limit] if t < config.duration_s)
    plan = Plan(config.workload, config.seed, salt=config.prompt_salt)
    fallback = plan.requests()
    specs = [
        salted(request_from_row(row, i, "trace", config.seed), config.prompt_salt or "")
        if {"prompt", "messages", "prompt_len"} & row.keys() else next(fallback)
        for i, row in enumerate(rows[:limit])
    ]
    return replace(plan, specs=specs, offsets=offsets[:limit])


def run_sync(coro):
    """Run a coroutine on a fresh event loop: uvloop where installed (it ships with
    uvicorn[standard]; its cheaper I/O keeps the schedule accurate at high rates).
    Ctrl-C raises KeyboardInterrupt here even where the coroutine swallowed the
    cancellation it caused (`_interruptible`)."""
    import os

    coro = _interruptible(coro)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if os.environ.get("PDC_LOADTEST_UVLOOP", "1") == "0":
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _interruptible(coro):
    """`coro`, ending in CancelledError whenever its task was cancelled, so the runner
    turns a Ctrl-C into KeyboardInterrupt. On Ctrl-C the runner cancels the main task
    and raises KeyboardInterrupt only if that cancellation comes out of it; a coroutine
    that caught it somewhere (a request's handler, a client's close) returned normally,
    and the run went on as if nothing had been pressed."""
    result = await coro
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result


def _indexed_workload(plan: Plan, client_id: int, num_clients: int) -> Iterator[tuple[int, RequestSpec]]:
    stream = enumerate(plan.requests())
    if plan.num_requests is not None:
        stream = itertools.islice(stream, plan.num_requests)
    return itertools.islice(stream, client_id, None, num_clients)


LAG_PROBE_S = 0.01


async def _watch_loop_lag(lags_s: list[float]) -> None:
    """How late a 10 ms timer fires: when this grows, the client itself is short of CPU
    and every figure it measures is late by about as much."""
    while True:
        due = time.perf_counter() + LAG_PROBE_S
        await asyncio.sleep(LAG_PROBE_S)
        lags_s.append(max(0.0, time.perf_counter() - due))


async def execute(
    plan: Plan, target: Target, caps: Caps, base: float | None = None, client_id: int = 0, num_clients: int = 1,
    on_record: OnRecord | None = None, loop_lags_s: list[float] | None = None,
) -> list[RequestRecord]:
    """Run `plan` (already this client's share) with time 0 at `base` (perf_counter; by
    default just after the HTTP client is ready). Nothing is sent before time 0. The event
    loop's timer lag is appended to `loop_lags_s` if given."""
    async with ClientShards() as http:
        if base is None:
            base = time.perf_counter() + 0.005
        await asyncio.sleep(max(0.0, base - time.perf_counter()))
        watcher = asyncio.create_task(_watch_loop_lag(loop_lags_s if loop_lags_s is not None else []))
        try:
            if plan.is_open_loop:
                records = await _open_loop(plan, http, target, caps, base, client_id, num_clients, on_record)
            else:
                records = await _closed_loop(plan, http, target, caps, base, client_id, num_clients, on_record)
        finally:
            watcher.cancel()
    return sorted(records, key=lambda r: r.index)


async def _send(http: ClientShards, target, caps, spec, record, base, on_record) -> RequestRecord:
    await send_request(http.pick(record.index), target, caps, spec, record, base)
    if on_record is not None:
        on_record(record)
    return record


async def _open_loop(plan, http, target, caps, base, client_id, num_clients, on_record) -> list[RequestRecord]:
    tasks = []
    for k, (spec, offset) in enumerate(zip(plan.specs, plan.offsets, strict=False)):
        while (delay := base + offset - time.perf_counter()) > 0:  # a timer may fire a little early
            await asyncio.sleep(delay)
        record = RequestRecord(client_id + k * num_clients, spec.request_id, spec.workload, offset, client_id=client_id)
        tasks.append(asyncio.create_task(_send(http, target, caps, spec, record, base, on_record)))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(plan, http, target, caps, base, client_id, num_clients, on_record) -> list[RequestRecord]:
    source = _indexed_workload(plan, client_id, num_clients)
    deadline = base + plan.duration_s if plan.duration_s is not None else math.inf
    records: list[RequestRecord] = []

    async def worker() -> None:
        for index, spec in source:  # one shared iterator: each request is taken once
            if time.perf_counter() >= deadline:
                return
            record = RequestRecord(index, spec.request_id, spec.workload, None, client_id=client_id)
            records.append(await _send(http, target, caps, spec, record, base, on_record))

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return records
