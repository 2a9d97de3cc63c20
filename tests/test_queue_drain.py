"""The router's model of a replica's queue (`router/queue_drain.py`) against the real
engine's scheduler: the step a priced prompt's first token comes at, with foreground and
background prompts queued ahead, and the phase arithmetic it is built from."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import queue_drain
from router.predict import foreground
from router.queue_drain import Own, after, drain, own_prompt, steps_for, tokens_in
from router.replica_load import ReplicaLoad, from_stats
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.cost_model import StepCoefficients

BUDGET = 64


def _streams(engine, n: int) -> None:
    for i, prompt in enumerate(random_prompts([5, 7, 6][:n], seed=21)):
        engine.add_request(f"s{i}", prompt, greedy(400, ignore_eos=True))
    while any(engine.requests[f"s{i}"].num_uncomputed_tokens > 1 for i in range(n)):
        engine.step()


def _steps_to_first_token(engine, request_id: str) -> int:
    steps = 0
    while True:
        steps += 1
        if any(o.request_id == request_id for o in engine.step()):
            return steps


@pytest.mark.parametrize("queue", [
    {"fg": [150], "bg": None},  # foreground ahead only
    {"fg": [], "bg": (200, 8)},  # a background prefill ahead, at 8 tokens a step
    {"fg": [150, 90], "bg": (200, 8)},  # both lanes
    {"fg": [300], "bg": (60, 16)},  # the background lane empties first
])
@pytest.mark.parametrize("own_background", [None, 12])
def test_the_first_token_comes_at_the_step_the_drain_predicts(make_engine, queue, own_background):
    engine = make_engine(max_num_batched_tokens=BUDGET, max_num_seqs=16)
    _streams(engine, 2)
    for i, n in enumerate(queue["fg"]):
        engine.add_request(f"fg{i}", random_prompts([n], seed=31 + i)[0], greedy(1, ignore_eos=True))
    if queue["bg"] is not None:
        n, chunk = queue["bg"]
        engine.add_request("bg", random_prompts([n], seed=30)[0],
                           greedy(1, ignore_eos=True, yield_to_decode=True, prefill_chunk_tokens=chunk))
    load = from_stats("d", "decode", engine.stats())
    own_prompt_ids = random_prompts([100], seed=39)[0]
    own = (foreground(load, 0, 100) if own_background is None
           else own_prompt(0, 100, own_background, background_chunk=own_background))
    predicted = drain(load, own)
    engine.add_request("own", own_prompt_ids, greedy(2, ignore_eos=True, yield_to_decode=own_background is not None,
                                                     prefill_chunk_tokens=own_background))
    measured = _steps_to_first_token(engine, "own")
    assert predicted.steps == measured, (predicted, measured)


@pytest.mark.parametrize("own_len", [20, 40])
def test_a_prompt_starts_in_the_step_of_the_prompts_queued_ahead_where_it_fits(make_engine, own_len):
    """A step computes as many prompts as its budget holds: 30 queued tokens, 2 streams and
    this prompt's 20 fit one step of 64; of 40, 32 fit and the rest takes one more step."""
    engine = make_engine(max_num_batched_tokens=BUDGET, max_num_seqs=16)
    _streams(engine, 2)
    for i, n in enumerate([10, 20]):
        engine.add_request(f"fg{i}", random_prompts([n], seed=31 + i)[0], greedy(1, ignore_eos=True))
    load = from_stats("d", "decode", engine.stats())
    predicted = drain(load, foreground(load, 0, own_len))
    engine.add_request("own", random_prompts([own_len], seed=39)[0], greedy(2, ignore_eos=True))
    assert predicted.steps == _steps_to_first_token(engine, "own") == own_len // 20
    assert predicted.own_steps == own_len // 20


def test_a_queued_background_prefill_is_priced_at_its_chunk_not_at_full_chunks(make_engine):
    """2,000 background tokens at 28 a step beside streams are ~72 cheap steps, not 4 of 512."""
    engine = make_engine(max_num_batched_tokens=BUDGET, max_num_seqs=16)
    _streams(engine, 2)
    engine.add_request("bg", random_prompts([200], seed=33)[0],
                       greedy(1, ignore_eos=True, yield_to_decode=True, prefill_chunk_tokens=8))
    load = from_stats("d", "decode", engine.stats())
    assert load.background_chunk_tokens == 8
    load = dataclasses.replace(load, coefficients=StepCoefficients(0.01, 1e-4, 0.0, 1e-3, 0.0))
    queue = drain(load)
    assert queue.busy_steps == 25  # 200 / 8
    whole_chunks = drain(dataclasses.replace(load, background_tokens=0, background_work=0))
    assert whole_chunks.busy_steps == 4  # the same 200 tokens as foreground: 62 a step
    assert queue.step_s == pytest.approx(0.01 + 2e-3 + 8e-4)
    assert whole_chunks.step_s == pytest.approx(0.01 + 2e-3 + 50 * 1e-4)


def test_without_streams_the_background_lane_takes_the_whole_budget(make_engine):
    engine = make_engine(max_num_batched_tokens=BUDGET)
    engine.add_request("bg", random_prompts([200], seed=34)[0],
                       greedy(1, ignore_eos=True, yield_to_decode=True, prefill_chunk_tokens=8))
    load = from_stats("d", "decode", engine.stats())
    assert drain(load).busy_steps == _steps_to_first_token(engine, "bg") == 4


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(0, 5000), r1=st.integers(1, 600), n1=st.integers(0, 50), r2=st.integers(1, 600),
       n2=st.integers(0, 50), r3=st.integers(1, 600))
def test_steps_for_and_tokens_in_agree_with_a_step_walk(tokens, r1, n1, r2, n2, r3):
    phases = [(r1, n1), (r2, n2), (r3, 0)]
    walk, left, k = 0, tokens, 0
    rates = [r1] * n1 + [r2] * n2
    while left > 0:
        left -= rates[k] if k < len(rates) else r3
        k += 1
    walk = k
    assert steps_for(tokens, phases) == walk
    assert tokens_in(walk, phases) >= tokens
    if walk:
        assert tokens_in(walk - 1, phases) < tokens
    shifted = after(phases, min(walk, n1 + n2))
    assert steps_for(tokens_in(walk, phases) - tokens_in(min(walk, n1 + n2), phases), shifted) == walk - min(walk, n1 + n2)


def test_an_own_prompt_counts_its_tokens_and_work():
    own = own_prompt(10, 110, 50)
    assert own == Own(100, 50 * 60 + 50 * 110, None)
    assert own_prompt(0, 100, 64, background_chunk=8).background_chunk == 8


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(1, 4000), streams=st.integers(0, 40), queued=st.integers(0, 8),
       chunk=st.sampled_from([None, 1, 16, 300]))
def test_an_empty_queue_takes_the_short_path_to_the_same_answer(tokens, streams, queued, chunk):
    r = ReplicaLoad("d", "decode", StepCoefficients(0.01, 1e-4, 1e-8, 1e-3, 1e-6), chunk_tokens=512,
                    num_streams=streams, stream_context=streams * 300, queued_streams=queued, queued_context=queued * 90)
    own = own_prompt(0, tokens, 512 - streams - queued, background_chunk=chunk)
    lanes = queue_drain._Lanes.of(r)
    full = queue_drain._foreground(r, lanes, own) if chunk is None else queue_drain._background(lanes, own)
    short = drain(r, own)
    assert (short.steps, short.busy_steps, short.own_steps) == (full.steps, full.busy_steps, full.own_steps)
    assert (short.seconds, short.busy_s, short.own_s) == pytest.approx((full.seconds, full.busy_s, full.own_s))


def test_the_view_knows_the_chunk_of_a_background_prefill_it_sent_before_any_heartbeat():
    from router.candidate import Candidate, Prediction
    from router.cluster_view import ClusterView, ReplicaInfo
    from router.placement import Placement
    from router.policy import RouteDecision

    view = ClusterView(16, 8)
    d1 = ReplicaInfo("d1", "decode", stats={"num_decoding": 2, "decode_context_tokens": 200})
    view.update([d1])
    chosen = Candidate("background", "d1", "d1", Prediction(1.0, 0.02, 0.03), chunk_tokens=24, num_streams=2)
    placement = Placement("decode", "d1", None, RouteDecision("local", "protect-streams", yield_prefill=True,
                                                              candidate=chosen, prediction=chosen.prediction), 0,
                          prefill_on="d1", prefill_tokens=900, prefill_work=400_000)
    view.begin(placement)
    load = view.load_of(d1)
    assert (load.background_tokens, load.background_chunk_tokens) == (900, 24)
    assert drain(load).busy_steps == 38  # 900 / 24 beside the streams, not 900 / 1022
    view.first_token(placement)
    assert view.load_of(d1).background_chunk_tokens == 0
