"""Turning a worker call into the HTTP answer: an SSE stream or one JSON body, with the
router's TTFT / ITL / E2E observations on the way."""

from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse

from router import dispatch, metrics, sse
from router.errors import APIError
from router.http_errors import error_response
from router.responses import ResponseShape

log = logging.getLogger("pdcluster.router")


class Timing:
    """TTFT, ITL and E2E of one request, as the router saw them.

    `content()` stamps a chunk's arrival; `record()` turns the stamps into observations.
    A stream calls `record()` after it has handed the chunk on, so the metrics (a
    Prometheus and a Ray histogram each) never delay a token on its way to the client."""

    def __init__(self, router_metrics: metrics.RouterMetrics, route: str, workload: str, arrival: float) -> None:
        self.metrics, self.route, self.workload = router_metrics, route, workload
        self.arrival = arrival
        self.last: float | None = None
        self._pending: list[tuple[bool, float]] = []  # (is the first token, seconds)

    def content(self) -> None:
        now = time.perf_counter()
        first = self.last is None
        self._pending.append((first, now - (self.arrival if first else self.last)))
        self.last = now

    def record(self) -> None:
        for first, seconds in self._pending:
            if first:
                self.metrics.observe_ttft(self.route, self.workload, seconds)
            else:
                self.metrics.observe_itl(self.route, self.workload, seconds)
        self._pending.clear()

    def finish(self) -> None:
        self.record()
        self.metrics.observe_e2e(self.route, self.workload, (self.last or time.perf_counter()) - self.arrival)


async def all_chunks(call: dispatch.Call):
    yield call.first
    async for chunk in call.rest():
        yield chunk


async def stream_sse(call: dispatch.Call, shape: ResponseShape, prompt_ids: list[int], include_usage: bool,
                  timing: Timing):
    num_tokens, ok = 0, False
    try:
        if shape.kind == "chat":
            yield sse.event(shape.role_chunk(prompt_ids))
            prompt_ids_once = None
        else:
            prompt_ids_once = prompt_ids
        async for chunk in all_chunks(call):
            if chunk.error is not None:
                yield sse.error_events({"error": chunk.error})
                return
            if chunk.token_ids or chunk.text:
                timing.content()
            num_tokens += len(chunk.token_ids)
            finish = chunk.finish_reason if chunk.finished else None
            if chunk.text or finish or (shape.return_token_ids and chunk.token_ids):
                yield sse.event(shape.chunk(chunk.text, chunk.token_ids, finish, prompt_ids_once))
                prompt_ids_once = None
            timing.record()  # after the event went out
        ok = True
    except Exception as e:  # noqa: BLE001 - the stream started: report in-band
        log.warning("request %s failed mid-stream: %r", shape.request_id, e)
        yield sse.error_events(APIError(503, "The serving replica failed mid-stream",
                                        code="replica_failed").body())
        return
    finally:
        call.close()
        if ok:
            timing.finish()
    if include_usage:
        yield sse.usage_chunk(shape.base(), len(prompt_ids), num_tokens)
    yield sse.DONE


async def collect_json(call: dispatch.Call, shape: ResponseShape, prompt_ids: list[int], timing: Timing,
                   headers: dict[str, str]) -> JSONResponse:
    texts: list[str] = []
    token_ids: list[int] = []
    finish_reason = None
    try:
        async for chunk in all_chunks(call):
            if chunk.error is not None:
                status = dispatch.error_status(chunk.error)
                return error_response(APIError.from_body(status, {"error": chunk.error}), headers)
            if chunk.token_ids or chunk.text:
                timing.content()
            texts.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            finish_reason = chunk.finish_reason or finish_reason
    except dispatch.WORKER_FAILURES as e:
        raise APIError(503, f"The serving replica failed: {type(e).__name__}", code="replica_failed") from None
    finally:
        call.close()
    timing.finish()
    return JSONResponse(shape.final("".join(texts), token_ids, finish_reason, prompt_ids), headers=headers)
