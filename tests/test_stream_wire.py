"""The worker stream's wire format without sockets: every request and chunk survives an
encode, seal, open and decode unchanged (property tests); malformed fields, tampered
or oversized messages and replays are refused."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.engine.sampling_params import GuidedDecoding, SamplingParams
from workers.engine.sequence import TokenLogprob
from workers.protocol import REASONS, GenerateChunk, GenerateRequest
from workers.stream.wire import (
    CHUNK,
    OPEN,
    ReplayGuard,
    StreamAuthError,
    StreamCodec,
    StreamRejected,
    chunk_from_wire,
    request_from_wire,
    to_wire,
)

KEY = "stream-test-key-0123456789abcdef"


def _request(n: int = 3, request_id: str = "req-1") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=[5, 6, 7],
                           params=SamplingParams(max_tokens=n, temperature=0.0, stop=["x"]),
                           seed=1, route="local", reason="forced", deadline=time.time() + 60)


requests = st.builds(
    GenerateRequest,
    request_id=st.text(max_size=40), prompt_token_ids=st.lists(st.integers(0, 1 << 31), max_size=50),
    params=st.builds(SamplingParams, max_tokens=st.integers(1, 10000),
                     temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(0, 100),
                     seed=st.none() | st.integers(0, 1 << 31), stop=st.lists(st.text(min_size=1), max_size=3),
                     stop_token_ids=st.lists(st.integers(0, 1000), max_size=3),
                     ignore_eos=st.booleans(), yield_to_decode=st.booleans(),
                     logprobs=st.none() | st.integers(0, 20), prompt_logprobs=st.none() | st.integers(0, 20),
                     frequency_penalty=st.floats(-2, 2), presence_penalty=st.floats(-2, 2),
                     repetition_penalty=st.floats(0.01, 10),
                     logit_bias=st.dictionaries(st.integers(0, 1 << 20), st.floats(-100, 100), max_size=4),
                     n=st.integers(1, 4), guided=st.none() | st.builds(
                         GuidedDecoding, kind=st.sampled_from(["json_schema", "regex"]), spec=st.text(min_size=1))),
    seed=st.integers(0, 1 << 31), route=st.sampled_from(["local", "disagg"]), reason=st.sampled_from(REASONS),
    workload=st.text(max_size=20), deadline=st.none() | st.floats(0, 2e9),
    prefill_timeout_s=st.floats(0.1, 100), target_replica=st.none() | st.text(max_size=20),
    prefill_replica=st.none() | st.text(max_size=20))


@given(requests)
def test_requests_survive_the_wire(req):
    codec = StreamCodec(KEY)
    msg = codec.open(codec.seal({"t": OPEN, "req": to_wire(req)}))
    assert request_from_wire(msg["req"]) == req


token_logprobs = st.builds(TokenLogprob, token_id=st.integers(0, 1 << 31),
                           logprob=st.floats(allow_nan=False, max_value=0),
                           top=st.lists(st.tuples(st.integers(0, 1 << 31), st.floats(allow_nan=False, max_value=0)),
                                        max_size=21).map(tuple))
chunks = st.builds(
    GenerateChunk, token_ids=st.lists(st.integers(0, 1 << 31), max_size=4), text=st.text(max_size=8),
    finished=st.booleans(), index=st.integers(0, 8),
    logprobs=st.none() | st.lists(token_logprobs, max_size=4),
    prompt_logprobs=st.none() | st.lists(st.none() | token_logprobs, max_size=6))


@given(chunks)
def test_chunks_with_logprobs_survive_the_wire(chunk):
    codec = StreamCodec(KEY)
    msg = codec.open(codec.seal({"t": CHUNK, "c": to_wire(chunk)}))
    assert chunk_from_wire(msg["c"]) == chunk


@pytest.mark.parametrize("logprobs", ["x", [[1, -0.5]], [["1", -0.5, []]], [[1, "-0.5", []]], [[-1, -0.5, []]],
                                      [[1, -0.5, [[2]]]], [[1, -0.5, [[2, -1.0]] * 22]]])
def test_malformed_logprobs_are_rejected(logprobs):
    raw = to_wire(GenerateChunk(token_ids=[1]))
    raw["logprobs"] = logprobs
    with pytest.raises(StreamRejected):
        chunk_from_wire(raw)


@pytest.mark.parametrize("field, value", [("prompt_token_ids", [1, -2]), ("prompt_token_ids", "abc"),
                                          ("seed", "1"), ("route", "elsewhere"), ("reason", "because"),
                                          ("workload", 1), ("deadline", "soon")])
def test_malformed_requests_are_rejected(field, value):
    raw = to_wire(_request())
    raw[field] = value
    with pytest.raises(StreamRejected):
        request_from_wire(raw)


def test_bad_params_tampering_and_size_are_rejected():
    raw = to_wire(_request())
    raw["params"]["max_tokens"] = 0
    with pytest.raises(StreamRejected, match="max_tokens"):
        request_from_wire(raw)
    for name, value in [("logit_bias", [["7", 1.0]]), ("logit_bias", [[7, 101.0]]), ("guided", {"kind": 1}),
                        ("guided", {"kind": "regex", "spec": ""}), ("logprobs", 21)]:
        raw = to_wire(_request())
        raw["params"][name] = value
        with pytest.raises(StreamRejected):
            request_from_wire(raw)
    codec = StreamCodec(KEY)
    body, mac = codec.seal({"t": "ping"})
    with pytest.raises(StreamAuthError):
        codec.open([body[:-1] + b"\x00", mac])
    with pytest.raises(StreamRejected):
        codec.open([b"\x00" * (codec.limits.max_body_bytes + 1), mac])
    with pytest.raises(StreamRejected):  # authentic, but not a message of ours
        codec.open(codec.seal({"t": "hello"}))


def test_replay_guard_forgets_only_what_the_clock_refuses():
    now = [1000.0]
    guard = ReplayGuard(window_s=10, clock=lambda: now[0])
    guard.check({"s": "a", "n": 1, "ts": now[0]})
    with pytest.raises(StreamRejected):
        guard.check({"s": "a", "n": 1, "ts": now[0]})
    for i in range(2000):
        guard.check({"s": f"s{i}", "n": 1, "ts": now[0]})
    now[0] += 25
    guard.check({"s": "fresh", "n": 1, "ts": now[0]})
    with pytest.raises(StreamRejected):  # forgotten session, but its old message is too old
        guard.check({"s": "a", "n": 1, "ts": now[0] - 25})
