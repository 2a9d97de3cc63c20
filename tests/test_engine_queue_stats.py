"""What a replica tells the router about its queue: the prefill work of a prompt range
in the engine's chunking, the queue and step model in `stats()`, and a background
prefill's per-request chunk size (`SamplingParams.prefill_chunk_tokens`)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from router.candidate import RequestShape
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine import SamplingParams
from workers.engine.cost_model import StepCoefficients, prefill_work


def brute_prefill_work(start: int, end: int, chunk: int) -> tuple[int, int, int]:
    chunks = [(pos, min(pos + chunk, end)) for pos in range(start, end, chunk)]
    return len(chunks), sum(e - s for s, e in chunks), sum((e - s) * e for s, e in chunks)


def test_prefill_work_matches_a_chunk_by_chunk_count():
    for start, length, chunk in itertools.product([0, 1, 15, 16, 100], [0, 1, 2, 15, 16, 17, 64, 333],
                                                  [1, 2, 16, 17, 64, 1024]):
        assert prefill_work(start, start + length, chunk) == brute_prefill_work(start, start + length, chunk)


def test_prefill_work_of_nothing_and_a_bad_chunk():
    assert prefill_work(10, 10, 8) == prefill_work(10, 3, 8) == (0, 0, 0)
    with pytest.raises(ValueError, match="chunk"):
        prefill_work(0, 10, 0)


QUEUE_KEYS = ("prompt_tokens_waiting", "prompt_attention_waiting", "num_decoding",
              "decode_context_tokens", "decode_tokens_remaining")


def test_a_lone_prompts_waiting_work_is_what_its_steps_record(make_engine):
    engine = make_engine(max_num_batched_tokens=32)
    prompt = random_prompts([100])[0]
    engine.add_request("a", prompt, greedy(3, ignore_eos=True))
    stats = engine.stats()
    assert stats["prompt_tokens_waiting"] == 100
    while engine.requests["a"].num_computed_tokens < len(prompt):
        engine.step()
    records = list(engine.step_records)
    assert stats["prompt_attention_waiting"] == sum(r.prefill_attention_work for r in records) > 0
    assert len(records) == prefill_work(0, 100, 32)[0]
    while engine.has_unfinished_requests():
        engine.step()


def test_stats_report_the_queue_and_the_step_model(make_engine, tiny_model_dir):
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request("a", random_prompts([100], seed=1)[0], greedy(10, ignore_eos=True))
    engine.add_request("b", random_prompts([50], seed=2)[0], greedy(6, ignore_eos=True))
    stats = engine.stats()
    assert {k: stats[k] for k in QUEUE_KEYS} == {
        "prompt_tokens_waiting": 150,
        "prompt_attention_waiting": prefill_work(0, 100, 32)[2] + prefill_work(0, 50, 32)[2],
        "num_decoding": 0, "decode_context_tokens": 0, "decode_tokens_remaining": 0}
    assert stats["prefill_progress"] == {}  # nothing computed yet: a router counts both whole
    engine.step()  # a's first chunk takes the whole budget
    stats = engine.stats()
    assert stats["prompt_tokens_waiting"] == 68 + 50
    assert stats["prompt_attention_waiting"] == prefill_work(32, 100, 32)[2] + prefill_work(0, 50, 32)[2]
    assert stats["prefill_progress"] == {"a": [68, prefill_work(32, 100, 32)[2]]}
    while any(not s.is_decoding for s in engine.requests.values()):
        engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    stats = engine.stats()
    assert {k: stats[k] for k in QUEUE_KEYS} == {
        "prompt_tokens_waiting": 0, "prompt_attention_waiting": 0, "num_decoding": 2,
        "decode_context_tokens": a.num_tokens + b.num_tokens,
        "decode_tokens_remaining": 10 - len(a.output_token_ids) + 6 - len(b.output_token_ids)}
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert all(stats[k] == 0 for k in QUEUE_KEYS) and stats["prefill_progress"] == {}
    assert json.loads(json.dumps(stats)) == stats  # plain values: they travel in heartbeats
    assert set(stats["step_model"]) == {f.name for f in dataclasses.fields(StepCoefficients)}
    assert 0 < stats["step_model"]["num_samples"] <= engine.cost_fit.num_samples  # as of the last refit
    assert stats["max_num_batched_tokens"] == 32
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # K and V, every layer, fp32
    assert stats["kv_bytes_per_token"] == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def _decode_streams(engine, n: int, max_tokens: int = 60) -> None:
    for i, prompt in enumerate(random_prompts([5, 7, 6][:n], seed=21)):
        engine.add_request(f"s{i}", prompt, greedy(max_tokens, ignore_eos=True))
    while any(not engine.requests[f"s{i}"].is_decoding for i in range(n)):
        engine.step()


def test_a_background_prefill_takes_its_own_chunk_while_streams_decode(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    _decode_streams(engine, 2, max_tokens=20)
    prompt = random_prompts([400], seed=22)[0]
    engine.add_request("bg", prompt, greedy(2, ignore_eos=True, yield_to_decode=True, prefill_chunk_tokens=11))
    seq, chunks, engine_chunks = engine.requests["bg"], [], set()
    engine.scheduler.yield_tokens = 3  # the engine-wide chunk (resized from the step records as they come)
    while seq.num_computed_tokens < len(prompt):
        before, streaming = seq.num_computed_tokens, any(f"s{i}" in engine.requests for i in range(2))
        engine_chunks.add(engine.scheduler.yield_tokens)
        engine.step()
        chunks.append((streaming, seq.num_computed_tokens - before))
    assert {n for streaming, n in chunks[:-1] if streaming} == {11}
    assert engine_chunks - {11}, "the engine-wide chunk never differed from the request's"
    assert {n for streaming, n in chunks[:-1] if not streaming} == {64}  # alone: full chunks
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
def test_a_background_prefills_own_chunk_changes_no_token(make_engine, chunk):
    prompt = random_prompts([200], seed=25)[0]
    alone = make_engine().generate([prompt], greedy(12))[0].token_ids
    engine = make_engine(max_num_batched_tokens=48)
    _decode_streams(engine, 3)
    engine.add_request("bg", prompt, greedy(12, yield_to_decode=True, prefill_chunk_tokens=chunk))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    assert outputs["bg"] == alone


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_prefill_chunk_tokens_is_validated(bad):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        SamplingParams(prefill_chunk_tokens=bad)


def test_prefill_chunk_tokens_travels_on_the_worker_stream():
    import msgpack

    from workers.protocol import REASONS, GenerateRequest
    from workers.stream.wire import request_from_wire, to_wire

    params = SamplingParams(max_tokens=4, yield_to_decode=True, prefill_chunk_tokens=24)
    req = GenerateRequest("r", [1, 2, 3], params, seed=7, route="local", reason=REASONS[0])
    assert request_from_wire(msgpack.unpackb(msgpack.packb(to_wire(req)))).params == params


def test_background_prefills_are_reported_apart(make_engine):
    engine = make_engine(max_num_batched_tokens=32)
    engine.add_request("fg", random_prompts([40], seed=3)[0], greedy(2, ignore_eos=True))
    bg_params = dataclasses.replace(greedy(2, ignore_eos=True), yield_to_decode=True)
    engine.add_request("bg", random_prompts([90], seed=4)[0], bg_params)
    stats = engine.stats()
    assert stats["prompt_tokens_waiting"] == 130 and stats["background_tokens_waiting"] == 90
    assert stats["background_attention_waiting"] == prefill_work(0, 90, 32)[2]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["background_tokens_waiting"] == 0


def test_a_foreground_prompt_is_priced_before_the_background_work_queued_there():
    from router import predict
    from router.replica_load import ReplicaLoad

    coefficients = StepCoefficients(0.005, 1e-4, 0.0, 5e-4, 0.0)
    req = RequestShape(prompt_len=200, max_tokens=8)
    behind_background = ReplicaLoad("d1", "decode", coefficients, chunk_tokens=512, queue_tokens=4000,
                                    background_tokens=4000)
    idle = ReplicaLoad("d1", "decode", coefficients, chunk_tokens=512)
    behind_foreground = dataclasses.replace(behind_background, background_tokens=0)
    alone = predict.local(req, idle, 0).prediction.ttft_s
    full_step = coefficients.fixed_s + coefficients.prefill_token_s * 512
    # at most the background step in progress ahead of it, not the 4000 tokens
    assert alone < predict.local(req, behind_background, 0).prediction.ttft_s <= alone + full_step
    assert predict.local(req, behind_foreground, 0).prediction.ttft_s > 10 * alone
