"""A response's way back through the router, without Ray: the worker call kinds and
dispatch (placing a draft, retrying once on another replica, deadlines and time limits),
SSE framing and JSON collection (logprobs, echo, n choices, usage, an error after the
start) and when TTFT and ITL are recorded (only after the chunk went out)."""

from __future__ import annotations

import json

import pytest

from cluster.config import WorkloadProfile
from router import metrics
from router.cluster_view import ClusterView
from router.errors import APIError

# ---- SSE framing -------------------------------------------------------------------


class _FakeStream:
    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def cancel(self):
        self.cancelled = True


def _shape(kind="completion", **options):
    from router.logprob_format import TokenTexts
    from router.responses import ResponseShape
    from workers.model_files import build_tokenizer

    return ResponseShape(kind, "r1", "tiny", TokenTexts(build_tokenizer()), **options)


def _runs(view, *chunk_lists, prompt_ids=(1, 2), prompt_text="ab"):
    from router import dispatch, streaming
    from router.placement import Placement
    from router.policy import RouteDecision

    runs = []
    for i, chunks in enumerate(chunk_lists):
        placement = Placement("decode", f"d{i}", None, RouteDecision("local", "short-prompt"), 0)
        view.begin(placement)
        call = dispatch.Call(placement, _FakeStream(chunks[1:]), chunks[0], view)
        runs.append(streaming.PromptRun(i, list(prompt_ids), prompt_text, call))
    return runs


def _run_stream(chunks, include_usage=True, shape=None):
    import asyncio

    from router import streaming

    view = ClusterView(16, 8)
    runs = _runs(view, chunks)
    timing = streaming.Timing(metrics.RouterMetrics("tiny"), "local", "default", 0.0)

    async def consume():
        return [e async for e in streaming.stream_sse(runs, shape or _shape(), include_usage, timing)]

    events = "".join(asyncio.run(consume()))
    assert view.inflight == {}  # the call was released
    # the view saw every token after the first chunk come back (its streams' progress)
    assert runs[0].call.placement.tokens_back == sum(len(c.token_ids) for c in chunks[1:])
    return events, runs[0].call.stream


def _collect(shape, *chunk_lists, **run_options):
    import asyncio

    from router import streaming

    view = ClusterView(16, 8)
    runs = _runs(view, *chunk_lists, **run_options)
    timing = streaming.Timing(metrics.RouterMetrics("tiny"), "local", "default", 0.0)
    response = asyncio.run(streaming.collect_json(runs, shape, timing, {}))
    assert view.inflight == {}
    return json.loads(response.body)


def test_completion_logprobs_keep_candidates_with_equal_texts_apart_by_id():
    """Two byte tokens of a split character both read as U+FFFD: `top_logprobs` (keyed by
    text) keeps one, `top_logprob_ids` (with return_token_ids) keeps both, so a near tie
    between them can still be seen."""
    from workers.engine.sequence import TokenLogprob
    from workers.protocol import GenerateChunk

    top = ((0xC3 + 3, -0.6931), (0xC4 + 3, -0.6936))  # byte ids are offset by the specials
    chunk = GenerateChunk(token_ids=[top[0][0]], text="", finished=True, finish_reason="length", route="local",
                          logprobs=[TokenLogprob(top[0][0], top[0][1], top)])
    by_text = _collect(_shape(logprobs=True), [chunk])["choices"][0]["logprobs"]
    assert len(by_text["top_logprobs"][0]) == 1 and "top_logprob_ids" not in by_text
    with_ids = _collect(_shape(logprobs=True, return_token_ids=True), [chunk])["choices"][0]["logprobs"]
    assert with_ids["top_logprob_ids"] == [[list(pair) for pair in top]]


def test_echo_with_logprobs_has_lm_eval_shape_and_drops_the_extra_token():
    """lm-eval's local-completions reads token_logprobs[ctxlen:-1] of each choice, in index order."""
    from workers.engine.sequence import TokenLogprob
    from workers.protocol import GenerateChunk

    prompt = [TokenLogprob(98, -0.5, ((97, -0.1),))]
    def chunks(token):
        return [GenerateChunk(token_ids=[token], text=chr(token), finished=True, finish_reason="length",
                              route="local", logprobs=[TokenLogprob(token, -1.0, ((token, -1.0),))],
                              prompt_logprobs=[None, *prompt])]
    body = _collect(_shape(logprobs=True, echo=True), chunks(99), chunks(100), prompt_ids=(97, 98),
                    prompt_text="ab")
    assert [c["index"] for c in body["choices"]] == [0, 1]
    first = body["choices"][0]
    assert first["text"] == "abc"
    assert first["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -0.5, -1.0],
                                 "top_logprobs": [None, {"a": -0.1}, {"c": -1.0}], "text_offset": [0, 1, 2]}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    only_prompt = _collect(_shape(logprobs=True, echo=True, drop_generated=True), chunks(99), prompt_ids=(97, 98))
    assert only_prompt["choices"][0]["text"] == "ab"
    assert only_prompt["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.5]
    assert only_prompt["usage"]["completion_tokens"] == 0


def test_chat_logprobs_shape_and_n_choices():
    from workers.engine.sequence import TokenLogprob
    from workers.protocol import GenerateChunk

    chunks = [GenerateChunk(token_ids=[104], text="h", route="local", index=1,
                            logprobs=[TokenLogprob(104, -0.25, ((104, -0.25), (105, -2.0)))]),
              GenerateChunk(token_ids=[105], text="i", index=0, finished=True, finish_reason="length",
                            logprobs=[TokenLogprob(105, -0.5, ())]),
              GenerateChunk(finished=True, finish_reason="length", index=1)]
    body = _collect(_shape("chat", logprobs=True, n=2), chunks)
    one = body["choices"][1]
    assert one["index"] == 1 and one["message"]["content"] == "h" and one["finish_reason"] == "length"
    assert one["logprobs"] == {"content": [
        {"token": "h", "logprob": -0.25, "bytes": [104],
         "top_logprobs": [{"token": "h", "logprob": -0.25, "bytes": [104]},
                          {"token": "i", "logprob": -2.0, "bytes": [105]}]}]}
    assert body["choices"][0]["message"]["content"] == "i"


def test_sse_error_after_start_is_one_event_then_done():
    from workers.protocol import GenerateChunk

    error = {"message": "deadline", "type": "timeout_error", "param": None, "code": "deadline_exceeded"}
    events, stream = _run_stream([GenerateChunk(token_ids=[5], text="a", route="local", reason="short-prompt"),
                                  GenerateChunk(finished=True, finish_reason="error", error=error)])
    frames = [f for f in events.split("\n\n") if f]
    assert json.loads(frames[0].removeprefix("data: "))["choices"][0]["text"] == "a"
    assert json.loads(frames[1].removeprefix("data: ")) == {"error": error}
    assert frames[2:] == ["data: [DONE]"]
    assert stream.cancelled  # the worker call is cancelled, not left running


def test_sse_usage_chunk_then_done():
    from workers.protocol import GenerateChunk

    events, _ = _run_stream([GenerateChunk(token_ids=[5], text="a", route="local"),
                             GenerateChunk(token_ids=[6], text="b", finished=True, finish_reason="length")])
    frames = [f.removeprefix("data: ") for f in events.split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert json.loads(frames[-3])["choices"][0]["finish_reason"] == "length"


# ---- dispatch ----------------------------------------------------------------------


def test_both_kinds_of_worker_call_satisfy_the_protocol():
    from ray.serve.handle import DeploymentResponseGenerator

    from router.dispatch import WorkerCall
    from workers.stream.client import StreamCall

    assert issubclass(StreamCall, WorkerCall) and issubclass(DeploymentResponseGenerator, WorkerCall)
    assert issubclass(_FakeStream, WorkerCall)


class _GoneStream(_FakeStream):
    async def __anext__(self):
        from workers.stream.client import ReplicaGone

        raise ReplicaGone("the replica went away")


class _FakeHandle:
    """A Serve handle (`options(stream=True).generate.remote(request)`) that keeps the
    requests it was given and answers each with the next of `streams`."""

    def __init__(self, streams):
        self.streams, self.requests = list(streams), []

    def options(self, stream):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.requests.append(request)
        return self.streams.pop(0)


def _draft(**kw):
    from router import dispatch
    from workers.engine.sampling_params import SamplingParams

    base = {"request_id": "r1", "prompt_ids": [1, 2, 3], "params": SamplingParams(max_tokens=4), "seed": 7,
            "workload": "chat", "profile": WorkloadProfile(deadline_s=5.0), "forced_mode": None,
            "offload_to_prefill": True, "prefill_timeout_s": 2.0, "first_chunk_timeout_s": 1.0}
    return dispatch.RequestDraft(**{**base, **kw})


def test_dispatch_places_the_draft_and_retries_once_on_another_replica():
    import asyncio
    import time

    from router import dispatch
    from router.cluster_view import ReplicaInfo
    from workers.protocol import GenerateChunk

    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode"), ReplicaInfo("d2", "decode", stats={"num_running": 1})])
    gone = _GoneStream([])
    serving = _FakeStream([GenerateChunk(token_ids=[5], text="a", route="local", reason="short-prompt"),
                           GenerateChunk(finished=True, finish_reason="stop")])
    handle = _FakeHandle([gone, serving])
    call = asyncio.run(dispatch.start(dispatch.Callers({"decode": handle}), view, _draft()))
    assert [r.target_replica for r in handle.requests] == ["d1", "d2"]  # d1 failed: excluded
    assert gone.cancelled and view.excluded == {"d1"}
    request = handle.requests[1]
    assert (request.request_id, request.prompt_token_ids, request.seed, request.workload) == ("r1", [1, 2, 3], 7, "chat")
    assert (request.route, request.reason, request.prefill_timeout_s) == ("local", "prefill-unhealthy", 2.0)
    assert request.prefill_address is None and not request.params.yield_to_decode
    assert time.time() < request.deadline <= time.time() + 5.0
    assert (call.path, call.route, call.reason) == ("handle", "local", "short-prompt")
    assert view.inflight == {"d2": 1}
    call.close()
    assert view.inflight == {} and serving.cancelled  # abandoned before its end: cancelled


def test_request_draft_writes_the_placement_into_the_request():
    from router.placement import Placement
    from router.policy import RouteDecision

    placement = Placement("decode", "d1", "p1", RouteDecision("local", "prefill-busy", yield_prefill=True), 0)
    request = _draft(profile=WorkloadProfile()).generate_request(placement, "tcp://p1")
    assert (request.target_replica, request.prefill_replica, request.prefill_address) == ("d1", "p1", "tcp://p1")
    assert request.params.yield_to_decode and request.params.max_tokens == 4 and request.deadline is None


class _SilentStream(_FakeStream):
    async def __anext__(self):
        import asyncio

        await asyncio.sleep(30)


def _start(stream):
    """`dispatch.start` on one decode replica whose call is `stream`; the error it raised."""
    import asyncio

    from router import dispatch
    from router.cluster_view import ReplicaInfo

    view = ClusterView(16, 8)
    view.update([ReplicaInfo("d1", "decode")])
    with pytest.raises(APIError) as e:
        asyncio.run(dispatch.start(dispatch.Callers({"decode": _FakeHandle([stream])}), view,
                                   _draft(first_chunk_timeout_s=0.05)))
    assert view.inflight == {} and stream.cancelled
    return e.value


def test_a_time_limit_that_ends_a_call_is_a_request_timeout_and_nothing_else_is():
    from router.errors import RequestTimedOut
    from workers.protocol import GenerateChunk

    def ending_with(code):
        error = {"message": code, "type": "timeout_error", "param": None, "code": code}
        return _FakeStream([GenerateChunk(finished=True, finish_reason="error", error=error, route="local")])

    silent = _start(_SilentStream([]))  # no first chunk within router.request_timeout_s
    assert isinstance(silent, RequestTimedOut)
    assert (silent.status, silent.code) == (503, "service_unavailable")  # what clients always saw
    deadline = _start(ending_with("deadline_exceeded"))
    assert isinstance(deadline, RequestTimedOut) and (deadline.status, deadline.code) == (503, "deadline_exceeded")
    for other in (_start(_FakeStream([])), _start(ending_with("replica_failed"))):
        assert not isinstance(other, RequestTimedOut) and other.status == 503


def test_a_deadline_mid_response_counts_one_timeout_for_the_tenant_and_workload():
    import asyncio

    from router import streaming
    from workers.protocol import GenerateChunk

    def chunks(code):
        error = {"message": code, "type": "timeout_error", "param": None, "code": code}
        return [GenerateChunk(token_ids=[5], text="a", route="local", reason="short-prompt"),
                GenerateChunk(finished=True, finish_reason="error", error=error)]

    async def respond(m, stream, code):
        timing = streaming.Timing(m, "local", "chat", 0.0, tenant="alpha")
        runs = _runs(ClusterView(16, 8), chunks(code))
        if stream:
            return [e async for e in streaming.stream_sse(runs, _shape(), False, timing)]
        return await streaming.collect_json(runs, _shape(), timing, {})

    m = metrics.RouterMetrics("tiny")
    for stream in (True, False):
        asyncio.run(respond(m, stream, "deadline_exceeded"))
        asyncio.run(respond(m, stream, "replica_failed"))
    samples = [s for f in metrics.snapshot(m.registry) for s in f["samples"]
               if s[0] == "pdc_request_timeouts_total"]
    assert samples == [["pdc_request_timeouts_total", {"model": "tiny", "tenant": "alpha", "workload": "chat"}, 2.0]]


def _count(m: metrics.RouterMetrics, name: str) -> float:
    return sum(s[2] for f in metrics.snapshot(m.registry) for s in f["samples"] if s[0] == f"{name}_count")


def test_timing_records_only_after_the_chunk_went_out():
    """The TTFT/ITL observations (Prometheus and Ray) run after the event is yielded, so
    they never delay a token; the stamps are taken when the chunk arrived."""
    import time

    from router import streaming

    m = metrics.RouterMetrics("tiny")
    arrival = time.perf_counter() - 0.5
    timing = streaming.Timing(m, "local", "default", arrival)
    timing.content()
    stamped = time.perf_counter()
    assert _count(m, "pdc_time_to_first_token_seconds") == 0  # stamped, not yet recorded
    time.sleep(0.05)
    timing.record()
    assert _count(m, "pdc_time_to_first_token_seconds") == 1
    ttft_sum = sum(s[2] for f in metrics.snapshot(m.registry) for s in f["samples"]
                   if s[0] == "pdc_time_to_first_token_seconds_sum")
    assert 0.5 <= ttft_sum <= stamped - arrival  # the chunk's arrival, not the recording time
    timing.content()
    timing.finish()  # records what is pending, then E2E
    assert _count(m, "pdc_inter_token_latency_seconds") == 1
    assert _count(m, "pdc_e2e_request_latency_seconds") == 1


def test_streamed_echo_opens_with_the_prompt_and_its_logprobs():
    from workers.engine.sequence import TokenLogprob
    from workers.protocol import GenerateChunk

    first = GenerateChunk(token_ids=[99], text="c", route="local", logprobs=[TokenLogprob(99, -1.0, ())],
                          prompt_logprobs=[None, TokenLogprob(2, -0.5, ())])
    last = GenerateChunk(token_ids=[100], text="d", finished=True, finish_reason="length",
                         logprobs=[TokenLogprob(100, -2.0, ())])
    events, _ = _run_stream([first, last], shape=_shape(logprobs=True, echo=True))
    frames = [json.loads(f.removeprefix("data: ")) for f in events.split("\n\n") if f and "[DONE]" not in f]
    choices = [f["choices"][0] for f in frames if f["choices"]]
    assert choices[0]["text"] == "abc" and choices[0]["logprobs"]["token_logprobs"] == [None, -0.5, -1.0]
    assert choices[1]["text"] == "d" and choices[1]["logprobs"]["text_offset"] == [3]
