"""Admission control on one router replica: who may start a request now.

In order, for each request:
1. the tenant's token bucket (`rate`, `burst`): empty -> 429, `Retry-After` = seconds
   until the next token;
2. the tenant's `concurrency` (running + queued): full -> 429, `Retry-After: 1`;
3. a global slot (`admission.max_concurrent_requests`): free -> run now; else wait in a
   bounded queue (`max_queued_requests`), interactive before batch, first come first
   served within a priority; queue full or `queue_timeout_s` spent waiting -> 429.

Every wait is bounded and every queue has a size, so overload never becomes an unbounded
wait or an out-of-memory. A granted `Ticket` is released exactly once, when the response
is finished (streams: when the stream ends or the client leaves). An `AdmissionObserver`
hears of every refusal (tenant, code) and of every admitted request's wait for a slot.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.errors import APIError
from router.tenants import ANONYMOUS, Quota, Tenants


def too_many(message: str, retry_after_s: float, code: str = "rate_limit_exceeded") -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, f"{message}; retry after {seconds} s", code=code,
                    headers={"retry-after": str(seconds)})


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.capacity = rate, float(burst)
        self.tokens, self.last = float(burst), now

    def take(self, now: float) -> float:
        """Take one token: 0.0 if there was one, else the seconds until there will be."""
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class AdmissionObserver(Protocol):
    """What admission reports (`router.metrics.RouterMetrics` records it)."""

    def record_rejected(self, tenant: str, code: str) -> None:
        """A request of `tenant` refused with a 429 of error `code`."""

    def observe_admission_wait(self, seconds: float) -> None:
        """A request admitted after waiting `seconds` for a slot (0.0: it did not wait)."""


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    future: asyncio.Future = field(compare=False)


class Ticket:
    """One admitted request's hold on its tenant's and the router's slots."""

    def __init__(self, admission: Admission, tenant: str) -> None:
        self._admission, self.tenant = admission, tenant
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self.tenant)


class Admission:
    def __init__(self, tenants: Tenants, max_concurrent: int, max_queued: int,
                 queue_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 observer: AdmissionObserver | None = None) -> None:
        self.tenants = tenants
        self.observer = observer
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self.num_running = 0
        self.per_tenant: Counter[str] = Counter()  # running + queued
        self.buckets: dict[str, TokenBucket] = {}
        self._queue: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_queued(self) -> int:
        return sum(1 for w in self._queue if not w.future.done())

    async def acquire(self, tenant: str | None) -> Ticket:
        """A ticket for `tenant`'s request (None: `anonymous`), or a 429 `APIError`."""
        tenant = tenant or ANONYMOUS
        try:
            ticket, waited_s = await self._admit(tenant)
        except APIError as refused:
            if self.observer is not None:
                self.observer.record_rejected(tenant, str(refused.code))
            raise
        if self.observer is not None:
            self.observer.observe_admission_wait(waited_s)
        return ticket

    async def _admit(self, tenant: str) -> tuple[Ticket, float]:
        """The ticket and the seconds spent waiting for a global slot."""
        quota = self.tenants.quota(tenant)
        self._check_rate(tenant, quota)
        if quota.concurrency is not None and self.per_tenant[tenant] >= quota.concurrency:
            raise too_many(f"Tenant {tenant} has {quota.concurrency} requests in flight, its quota", 1.0,
                           code="concurrency_limit_exceeded")
        self.per_tenant[tenant] += 1
        ticket = Ticket(self, tenant)
        try:
            waited_s = await self._global_slot(quota)
        except BaseException:
            self._untrack(tenant)
            ticket.released = True
            raise
        return ticket, waited_s

    def _check_rate(self, tenant: str, quota: Quota) -> None:
        if quota.rate is None:
            return
        now = self.clock()
        bucket = self.buckets.get(tenant)
        if bucket is None:
            bucket = self.buckets[tenant] = TokenBucket(quota.rate, quota.burst or 1, now)
        wait_s = bucket.take(now)
        if wait_s > 0:
            raise too_many(f"Tenant {tenant} is over its rate of {quota.rate:g} requests/s", wait_s)

    async def _global_slot(self, quota: Quota) -> float:
        """Take a slot, queueing for one if none is free; returns the seconds queued."""
        if self.num_running < self.max_concurrent and not self.num_queued:
            self.num_running += 1
            return 0.0
        if self.num_queued >= self.max_queued:
            raise too_many(f"The server is at capacity ({self.max_concurrent} running, "
                           f"{self.max_queued} queued)", 1.0, code="server_overloaded")
        waiter = _Waiter(quota.rank, next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(self._queue, waiter)
        start = self.clock()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout_s)
        except asyncio.TimeoutError:
            if not waiter.future.done():
                waiter.future.cancel()
                raise too_many(f"Queued for {self.queue_timeout_s:g} s without a free slot",
                               1.0, code="server_overloaded") from None
        except BaseException:  # the client left while queued
            if waiter.future.done() and not waiter.future.cancelled():
                self._free_slot()  # it was granted a slot it will never use
            else:
                waiter.future.cancel()
            raise
        return self.clock() - start

    def _release(self, tenant: str) -> None:
        self._untrack(tenant)
        self._free_slot()

    def _untrack(self, tenant: str) -> None:
        self.per_tenant[tenant] -= 1
        if self.per_tenant[tenant] <= 0:
            del self.per_tenant[tenant]

    def _free_slot(self) -> None:
        """Hand the slot to the best live waiter, else give it back."""
        while self._queue:
            waiter = heapq.heappop(self._queue)
            if not waiter.future.done():
                waiter.future.set_result(None)
                return
        self.num_running -= 1

    def state(self) -> dict:
        return {"num_running": self.num_running, "num_queued": self.num_queued,
                "per_tenant": dict(self.per_tenant)}


async def release_after(chunks: AsyncIterator, ticket: Ticket) -> AsyncIterator:
    """Stream `chunks`, then release `ticket` (also when the client leaves mid-stream)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        ticket.release()


def hold_until_sent(response, ticket: Ticket):
    """Release `ticket` when `response` is finished: now for a plain body, at the end of
    the stream for a StreamingResponse (or when the never-started stream is collected)."""
    body = getattr(response, "body_iterator", None)
    if body is None:
        ticket.release()
        return response
    response.body_iterator = release_after(body, ticket)
    weakref.finalize(response.body_iterator, ticket.release)
    return response
