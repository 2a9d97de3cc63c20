"""The streams' TPOT beside a prompt, priced through the steps they will see in order.

A replica's foreground prompts take full-budget chunks first while a background prefill
trails on after them at its small chunk, so a stream a few tokens from its end sees only
the heavy steps. Priced at the mean step of everything queued, two streams 15 tokens from
their end beside a 1,500-token foreground prompt and a background prefill looked 63 ms a
token; one saw 121.

The check runs the real engine's scheduler and prices each step it takes with the same
step model the prediction uses, so only the order and mix of steps is under test.
"""

from __future__ import annotations

import dataclasses

import pytest

from router import predict, replica_steps
from router.candidate import RequestShape
from router.queue_drain import drain
from router.replica_load import from_stats
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.cost_model import StepCoefficients, predict_step_s, step_features

BUDGET = 64
MODEL = StepCoefficients(0.01, 4e-4, 0.0, 1e-3, 0.0)


def _two_streams(engine, tokens_left: int) -> None:
    for i, prompt in enumerate(random_prompts([5, 7], seed=21)):
        engine.add_request(f"s{i}", prompt, greedy(tokens_left + 1, ignore_eos=True))
    while any(not engine.requests[f"s{i}"].output_token_ids for i in range(2)):
        engine.step()


def _walked_gap(engine, stream: str) -> float:
    """The stream's mean gap until it ends, each step priced by `MODEL`."""
    costs = []
    while stream in engine.requests and not engine.requests[stream].is_finished:
        outputs = engine.step()
        if any(o.request_id == stream for o in outputs):
            costs.append(predict_step_s(MODEL, step_features(engine.step_records[-1])))
    return sum(costs) / len(costs)


@pytest.mark.parametrize("tokens_left", [4, 12])
def test_streams_near_their_end_are_priced_at_the_foreground_chunks_they_see(make_engine, tokens_left):
    engine = make_engine(max_num_batched_tokens=BUDGET, max_num_seqs=16)
    _two_streams(engine, tokens_left)
    engine.add_request("bg", random_prompts([400], seed=30)[0],
                       greedy(1, ignore_eos=True, yield_to_decode=True, prefill_chunk_tokens=8))
    load = dataclasses.replace(from_stats("d", "decode", engine.stats()), coefficients=MODEL,
                               recent_gap_s=None, prompt_token_rate=0.0, prompt_work_rate=0.0)
    assert load.stream_tokens_left == tokens_left
    own = RequestShape(prompt_len=200, max_tokens=2)
    predicted = predict.local(own, load, cached=0).prediction.streams_tpot_s
    engine.add_request("own", random_prompts([200], seed=39)[0], greedy(2, ignore_eos=True))
    walked = _walked_gap(engine, "s0")
    assert predicted == pytest.approx(walked, rel=0.1)
    queue = drain(load, predict.foreground(load, 0, 200))
    assert queue.step_s < 0.8 * walked  # the mean step of all queued would price it far below


def test_phases_split_a_queue_into_its_foreground_then_its_trailing_background():
    load = dataclasses.replace(
        from_stats("d", "decode", {"num_decoding": 2, "decode_context_tokens": 20, "max_num_batched_tokens": 64,
                                   "prompt_tokens_waiting": 500, "background_tokens_waiting": 400,
                                   "background_chunk_tokens": 8}),
        coefficients=MODEL)
    queue = drain(load)
    (head_steps, head_s), (tail_steps, tail_s) = queue.phases
    assert head_steps == 2  # 100 foreground tokens at 54 a step beside the background's 8
    assert head_steps + tail_steps == queue.busy_steps == 50  # 400 / 8
    assert head_s > 2 * tail_s
    assert head_steps * head_s + tail_steps * tail_s == pytest.approx(queue.busy_s)


def test_streams_wait_through_a_prompts_steps_stretched_as_their_decode_steps_are():
    """A replica whose streams' recent gaps ran past its step model (other work on the
    node, streams that came and went) and where prompts keep arriving: a step that also
    prefills is stretched by both, as `expected_gap_s` stretches a decode step, so it is
    never quicker to the streams than the gaps they see anyway."""
    bare = dataclasses.replace(
        from_stats("d", "decode", {"num_decoding": 2, "decode_context_tokens": 20, "max_num_batched_tokens": 64}),
        coefficients=MODEL, recent_gap_s=None, prompt_token_rate=0.0, prompt_work_rate=0.0)
    phases = ((3.0, 0.030), (10.0, 0.015))
    assert replica_steps.as_streams_see(bare, phases) == phases
    step = replica_steps.decode_step_s(bare)  # 12 ms
    lagging = dataclasses.replace(bare, recent_gap_s=step + 0.010, prompt_token_rate=500.0)  # a fifth of its time
    seen = replica_steps.as_streams_see(lagging, phases)
    assert [n for n, _ in seen] == [3.0, 10.0]
    assert seen[0][1] == pytest.approx((0.030 + (1 - replica_steps.NOW_WEIGHT) * 0.010) / 0.8)
    assert replica_steps.as_streams_see(lagging, ((1.0, step),))[0][1] == pytest.approx(replica_steps.expected_gap_s(lagging))
