"""Turning a request's worker calls into the HTTP answer: an SSE stream or one JSON body,
with the router's TTFT / ITL / E2E observations on the way.

A completions request with several prompts runs one call per prompt, concurrently; their
chunks are interleaved as they come (each names its choice by `index`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from router import dispatch, metrics, sse
from router.errors import APIError, RequestTimedOut
from router.http_errors import error_response
from router.responses import ChoiceState, ResponseShape
from router.tenants import ANONYMOUS
from workers.protocol import GenerateChunk

log = logging.getLogger("pdcluster.router")


@dataclass
class PromptRun:
    """One prompt of the request and the worker call that runs it."""

    index: int  # the prompt's position in the request
    prompt_ids: list[int]
    prompt_text: str
    call: dispatch.Call


class Timing:
    """TTFT, ITL and E2E of one request, as the router saw them.

    `content()` stamps a chunk's arrival; `record()` turns the stamps into observations.
    A stream calls `record()` after it has handed the chunk on, so the metrics (a
    Prometheus and a Ray histogram each) never delay a token on its way to the client.
    `finish()` hands `on_finish` the request's TTFT, TPOT (mean gap after the first
    token; None under two tokens) and the KV transfer's tail where a chunk said it
    (`GenerateChunk.transfer_tail_s`; else None), which the routing policy learns from.
    `failed()` counts a request a time limit ended, by its `tenant`."""

    def __init__(self, router_metrics: metrics.RouterMetrics, route: str, workload: str, arrival: float,
                 on_finish: Callable[[float, float | None, float | None], None] | None = None,
                 tenant: str = ANONYMOUS) -> None:
        self.metrics, self.route, self.workload = router_metrics, route, workload
        self.tenant = tenant
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        self.transfer_tail_s: float | None = None
        self.on_finish = on_finish
        self._pending: list[tuple[bool, float]] = []  # (is the first token, seconds)

    def chunk(self, chunk: GenerateChunk) -> None:
        """Stamp a chunk that carries content, and keep what it says of its transfer."""
        if chunk.transfer_tail_s is not None:
            self.transfer_tail_s = chunk.transfer_tail_s
        if chunk.token_ids or chunk.text:
            self.content(max(1, len(chunk.token_ids)))

    def content(self, num_tokens: int = 1) -> None:
        now = time.perf_counter()
        first = self.last is None
        self._pending.append((first, now - (self.arrival if first else self.last)))
        if first:
            self.first = now
        self.last = now
        self.num_tokens += num_tokens

    def record(self) -> None:
        for first, seconds in self._pending:
            if first:
                self.metrics.observe_ttft(self.route, self.workload, seconds)
            else:
                self.metrics.observe_itl(self.route, self.workload, seconds)
        self._pending.clear()

    def failed(self, error: APIError) -> None:
        if isinstance(error, RequestTimedOut):
            self.metrics.record_timeout(self.tenant, self.workload)

    def finish(self) -> None:
        self.record()
        self.metrics.observe_e2e(self.route, self.workload, (self.last or time.perf_counter()) - self.arrival)
        if self.on_finish is not None and self.first is not None:
            tpot = (self.last - self.first) / (self.num_tokens - 1) if self.num_tokens >= 2 else None
            self.on_finish(self.first - self.arrival, tpot, self.transfer_tail_s)


async def all_chunks(call: dispatch.Call):
    yield call.first
    async for chunk in call.rest():
        yield chunk


async def merged_chunks(runs: list[PromptRun]) -> AsyncIterator[tuple[PromptRun, GenerateChunk]]:
    """Every run's chunks, each run's in order, interleaved as they arrive."""
    if len(runs) == 1:
        async for chunk in all_chunks(runs[0].call):
            yield runs[0], chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: PromptRun) -> None:
        try:
            async for chunk in all_chunks(run.call):
                await queue.put((run, chunk, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put((run, None, e))
        await queue.put((run, None, None))

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        num_open = len(runs)
        while num_open:
            run, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                num_open -= 1
                continue
            yield run, chunk
    finally:
        for task in tasks:
            task.cancel()


def close_all(runs: list[PromptRun]) -> None:
    for run in runs:
        run.call.close()


def _states(runs: list[PromptRun], n: int) -> dict[int, ChoiceState]:
    return {run.index * n + j: ChoiceState(run.index * n + j, run.prompt_ids, run.prompt_text)
            for run in runs for j in range(n)}


def _state_for(states: dict[int, ChoiceState], run: PromptRun, chunk: GenerateChunk, n: int) -> ChoiceState:
    index = run.index * n + chunk.index
    if index not in states:  # best_of > n: the engine reports only the n returned
        states[index] = ChoiceState(index, run.prompt_ids, run.prompt_text)
    return states[index]


def _num_prompt_tokens(runs: list[PromptRun]) -> int:
    return sum(len(run.prompt_ids) for run in runs)


async def stream_sse(runs: list[PromptRun], shape: ResponseShape, include_usage: bool, timing: Timing):
    states = _states(runs, shape.n)
    prompt_ids_once = runs[0].prompt_ids if len(runs) == 1 else None
    ok = False
    try:
        if shape.kind == "chat":
            for index in sorted(states):
                yield sse.event(shape.role_chunk(index, prompt_ids_once))
                prompt_ids_once = None
        async for run, chunk in merged_chunks(runs):
            if chunk.error is not None:
                timing.failed(dispatch.worker_error(chunk.error))
                yield sse.error_events({"error": chunk.error})
                return
            timing.chunk(chunk)
            state = _state_for(states, run, chunk, shape.n)
            piece = shape.piece(state, chunk)
            finish = chunk.finish_reason if chunk.finished else None
            if piece.text or finish or piece.logprobs or (shape.return_token_ids and piece.token_ids):
                yield sse.event(shape.chunk(state.index, piece, finish, prompt_ids_once))
                prompt_ids_once = None
            timing.record()  # after the event went out
        ok = True
    except Exception as e:  # noqa: BLE001 - the stream started: report in-band
        log.warning("request %s failed mid-stream: %r", shape.request_id, e)
        yield sse.error_events(APIError(503, "The serving replica failed mid-stream",
                                        code="replica_failed").body())
        return
    finally:
        close_all(runs)
        if ok:
            timing.finish()
    if include_usage:
        num_generated = sum(len(s.token_ids) for s in states.values())
        yield sse.usage_chunk(shape.base(), _num_prompt_tokens(runs), num_generated)
    yield sse.DONE


async def collect_json(runs: list[PromptRun], shape: ResponseShape, timing: Timing,
                       headers: dict[str, str]) -> JSONResponse:
    states = _states(runs, shape.n)
    try:
        async for run, chunk in merged_chunks(runs):
            if chunk.error is not None:
                error = dispatch.worker_error(chunk.error)
                timing.failed(error)
                return error_response(error, headers)
            timing.chunk(chunk)
            shape.piece(_state_for(states, run, chunk, shape.n), chunk)
    except dispatch.WORKER_FAILURES as e:
        raise APIError(503, f"The serving replica failed: {type(e).__name__}", code="replica_failed") from None
    finally:
        close_all(runs)
    timing.finish()
    prompt_ids = runs[0].prompt_ids if len(runs) == 1 else None
    body = shape.final(list(states.values()), _num_prompt_tokens(runs), prompt_ids)
    return JSONResponse(body, headers=headers)
