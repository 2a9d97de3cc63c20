"""Router units without Ray: request validation (with a fuzz), workload precedence,
metrics merge, the control plane's logic, the admin checks, replica pinning, API keys and
SSE framing. (Placement and its prefix index: test_router_placement.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.config import WorkloadProfile
from router import metrics
from router.admin import check_admin, parse_profile
from router.cluster_view import ClusterView
from router.control_plane import ControlPlaneCore
from router.errors import APIError
from router.ingress import _parse
from router.profiles import Profiles, client_mode

# ---- request validation ------------------------------------------------------------


def parse(kind, body):
    return _parse(kind, body)


def test_valid_requests():
    req = parse("completion", {"prompt": [1, 2, 3], "stop": "x", "stream": True,
                               "stream_options": {"include_usage": True}, "top_k": -1})
    assert req.include_usage and req.sampling_params(4).stop == ("x",)
    assert req.sampling_params(4).top_k == 0
    chat = parse("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                          "max_completion_tokens": 3, "return_token_ids": True, "ignore_eos": True})
    assert chat.max_tokens == 3 and chat.template_messages() == [{"role": "user", "content": "a"}]
    assert parse("completion", {"prompt": ["one"]}).prompts == ["one"]
    assert parse("completion", {"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    echo = parse("completion", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0, "n": 2})
    params = echo.sampling_params(1)
    assert (params.logprobs, params.prompt_logprobs, params.n) == (1, 1, 2)
    chat = parse("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2,
                          "frequency_penalty": 0.5, "logit_bias": {"7": -100}, "user": "u", "metadata": {},
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "o", "schema": {"type": "object"}}}})
    params = chat.sampling_params(4)
    assert (params.logprobs, params.frequency_penalty, params.logit_bias) == (2, 0.5, ((7, -100.0),))
    assert params.guided.kind == "json_schema" and json.loads(params.guided.spec) == {"type": "object"}


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", {}, "prompt"),
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"prompt": [-1]}, "prompt"),
        ("completion", {"prompt": ["a", ""]}, "prompt"),
        ("completion", {"prompt": "x", "n": 0}, "n"),
        ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("completion", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("completion", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ("completion", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
        ("completion", {"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user"}]}, "messages.0.content"),
        ("completion", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("completion", {"prompt": "x", "temperature": -1}, "temperature"),
        ("completion", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completion", {"prompt": "x", "seed": 2**70}, "seed"),
        ("completion", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completion", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("completion", {"prompt": "x", "stop": [""]}, "stop"),
        ("completion", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ("chat", {"messages": "hi"}, "messages"),
    ],
)
def test_invalid_requests_are_400_naming_the_field(kind, body, param):
    with pytest.raises(APIError) as info:
        parse(kind, body)
    assert info.value.status == 400
    assert (info.value.param or "").startswith(param)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
    | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
                          "stop", "stream", "stream_options", "n", "min_tokens", "stop_token_ids",
                          "ignore_eos", "return_token_ids", "model", "logprobs", "echo", "best_of",
                          "frequency_penalty", "logit_bias", "response_format", "guided_choice",
                          "top_logprobs", "suffix", "tools"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["completion", "chat"]),
       body=st.dictionaries(fields, json_values, max_size=6) | json_values)
def test_fuzz_malformed_bodies_only_ever_4xx(kind, body):
    try:
        req = parse(kind, body)
    except APIError as e:
        assert 400 <= e.status < 500
        json.dumps(e.body())
        return
    # What validates must also make valid engine params.
    req.sampling_params(max(req.max_tokens or 1, req.min_tokens, 1))


# ---- workloads ---------------------------------------------------------------------


def test_profile_precedence():
    profiles = Profiles(1, {"default": WorkloadProfile(), "rag": WorkloadProfile(mode="disagg"),
                            "chat": WorkloadProfile(mode="local"), "m": WorkloadProfile()})
    assert profiles.resolve("rag", "chat", "m") == "rag"
    assert profiles.resolve(None, "chat", "m") == "chat"
    assert profiles.resolve(None, None, "m") == "m"
    assert profiles.resolve(None, None, None) == "default"
    assert profiles.resolve("unknown", "chat", "m") == "default"
    assert profiles.get("nope").mode == "auto"


def test_client_override_only_where_allowed():
    assert client_mode(WorkloadProfile(allow_client_override=True), "Disagg") == "disagg"
    assert client_mode(WorkloadProfile(allow_client_override=False), "disagg") is None
    assert client_mode(WorkloadProfile(), "sideways") is None
    assert client_mode(WorkloadProfile(), None) is None


# ---- metrics -----------------------------------------------------------------------


def test_metrics_merge_sums_counters_keeps_gauges_apart():
    a, b = metrics.RouterMetrics("tiny"), metrics.RouterMetrics("tiny")
    for m in (a, b):
        m.record_route("local", "short-prompt", "default")
        m.observe_ttft("local", "default", 0.01)
    text_gauges = (
        '# TYPE pdc_kv_blocks_free gauge\npdc_kv_blocks_free{model="tiny",pool="decode",replica="r1"} 5\n'
        '# TYPE pdc_prefix_cache_hits counter\npdc_prefix_cache_hits_total{model="tiny"} 2\n')
    text_gauges2 = text_gauges.replace('replica="r1"', 'replica="r2"').replace("} 5", "} 7")
    merged = metrics.merge([metrics.snapshot(a.registry), metrics.snapshot(b.registry),
                            metrics.from_text(text_gauges), metrics.from_text(text_gauges2)])
    out = metrics.render(json.loads(json.dumps(merged))).decode()
    assert 'pdc_route_decisions_total{model="tiny",reason="short-prompt",route="local",workload="default"} 2.0' in out
    assert 'pdc_time_to_first_token_seconds_count{model="tiny",route="local",workload="default"} 2.0' in out
    assert 'pdc_prefix_cache_hits_total{model="tiny"} 4.0' in out
    assert 'replica="r1"} 5.0' in out and 'replica="r2"} 7.0' in out
    assert "_created" not in out


# ---- control plane -----------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_control_plane_profiles_versions_and_registry():
    clock = Clock()
    cp = ControlPlaneCore({"rag": {"mode": "disagg"}}, heartbeat_timeout_s=3.0, clock=clock)
    state = cp.get_state(None)
    assert set(state.profiles) == {"rag", "default"}
    assert cp.get_state(state.version).profiles is None  # unchanged: not resent
    version = cp.set_profile("rag", {"mode": "local"})
    assert version == state.version + 1
    assert cp.get_state(state.version).profiles["rag"]["mode"] == "local"
    with pytest.raises(ValueError):
        cp.set_profile("bad", {"mode": "never"})

    assert cp.heartbeat("d1", {}) is False  # unknown: the worker must register
    cp.register("d1", "decode", "node", "tcp://1.2.3.4:5", layout_fingerprint="abc")
    assert cp.heartbeat("d1", {"num_running": 2, "num_waiting": 1}, '# TYPE x gauge\nx 1\n') is True
    (info,) = cp.get_state().replicas
    assert info.healthy and info.load == 3 and info.extra == {"layout_fingerprint": "abc"}
    clock.now += 5  # heartbeat overdue
    assert not cp.get_state().replicas[0].healthy
    clock.now += 100  # forgotten, its counters retired into the sums
    assert cp.get_state().replicas == []


def test_control_plane_keeps_counters_of_forgotten_sources():
    clock = Clock()
    cp = ControlPlaneCore({}, clock=clock)
    m = metrics.RouterMetrics("tiny")
    m.record_route("disagg", "long-prompt", "default")
    cp.push_metrics("router:a", metrics.snapshot(m.registry))
    clock.now += 1000
    cp.push_metrics("router:b", metrics.snapshot(m.registry))
    assert 'reason="long-prompt",route="disagg",workload="default"} 2.0' in cp.render_metrics().decode()


def test_control_plane_names_the_sources_behind_a_moment():
    clock = Clock()
    cp = ControlPlaneCore({}, clock=clock)
    cp.register("d1", "decode")
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 1\n")
    cp.push_metrics("router:a", "# TYPE y counter\ny_total 1\n")
    since = cp.now()
    assert cp.stale_sources(since - 1) == []
    assert cp.stale_sources(since + 0.5) == ["d1", "router:a"]
    clock.now += 0.5
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 2\n")
    assert cp.stale_sources(since + 0.5) == ["router:a"]
    clock.now += 1000  # a source silent past the forget horizon is retired, not waited for
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 3\n")
    assert cp.stale_sources(clock.now) == []


def test_replace_profiles_from_reconfigure_keeps_default():
    cp = ControlPlaneCore({})
    cp.replace_profiles({"x": {"mode": "local"}})
    assert set(cp.get_profiles()[1]) == {"x", "default"}


# ---- admin -------------------------------------------------------------------------


def test_admin_auth():
    with pytest.raises(APIError) as info:
        check_admin("Bearer x", None)
    assert info.value.status == 403
    for header in (None, "Bearer wrong", "Basic secret", "secret"):
        with pytest.raises(APIError) as info:
            check_admin(header, "secret")
        assert info.value.status == 401
    check_admin("Bearer secret", "secret")


def test_admin_profile_must_be_full_and_valid():
    full = {"mode": "local", "min_remote_prefill_tokens": 1, "max_prefill_queue": 1,
            "allow_client_override": False}
    assert parse_profile("rag", full).mode == "local"
    for body, param in (({k: v for k, v in full.items() if k != "mode"}, "mode"),
                        ({**full, "mode": "x"}, "mode"), ({**full, "max_prefill_queue": "1"}, "max_prefill_queue"),
                        ({**full, "extra": 1}, "extra"), ([], None)):
        with pytest.raises(APIError) as info:
            parse_profile("rag", body)
        assert info.value.status == 400 and info.value.param == param


# ---- replica pinning and API keys --------------------------------------------------


class _Replica:
    def __init__(self, unique_id):
        self.replica_id = type("RID", (), {"unique_id": unique_id})()


class _Pending:
    def __init__(self, target):
        self.args = [type("Req", (), {"target_replica": target})()]
        self.kwargs = {}


def test_target_replica_router_pins_or_falls_back():
    import asyncio

    from router.replica_router import TargetReplicaRouter

    replicas = [_Replica("a"), _Replica("b")]
    choose = TargetReplicaRouter.choose_replicas
    assert asyncio.run(choose(None, replicas, _Pending("b"))) == [[replicas[1]]]
    assert asyncio.run(choose(None, replicas, _Pending("gone"))) == [replicas]
    assert asyncio.run(choose(None, replicas, _Pending(None))) == [replicas]
    assert asyncio.run(choose(None, replicas, None)) == [replicas]


def test_api_keys_file(tmp_path):
    from router.api_keys import ApiKeys

    assert ApiKeys.load(None) is None
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  sk-a: {tenant: a, workload: rag}\n")
    keys = ApiKeys.load(path)
    assert keys.check("Bearer sk-a").workload == "rag"
    for header in (None, "Bearer sk-b", "sk-a"):
        with pytest.raises(APIError) as info:
            keys.check(header)
        assert info.value.status == 401


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
