"""The recent past of a replica's streams: the mean gap between their tokens (start to
start of consecutive decoding steps, weighted by streams) and their mean batch, over a
time window of step records; what a replica reports of it, and how a prediction of TPOT
blends it with the state now."""

from __future__ import annotations

import time

import pytest

from router import predict, replica_steps
from router.candidate import RequestShape
from router.replica_load import ReplicaLoad, from_stats
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.cost_model import StepCoefficients
from workers.engine.recent_load import MIN_STEPS, WINDOW_S, recent_load
from workers.engine.step_cost import StepRecord


def step(at: float, decode_seqs: int, step_s: float = 0.01, prefill: int = 0, finished: int = 0) -> StepRecord:
    return StepRecord(start_time=at, step_time_s=step_s, num_prefill_tokens=prefill, num_decode_seqs=decode_seqs,
                      num_context_tokens=0, num_running=decode_seqs - finished, num_waiting=0,
                      num_finished_streams=finished)


def test_the_gap_is_weighted_by_streams_and_the_batch_by_time():
    # 10 steps of 2 streams 20 ms apart, then 10 of 6 streams 50 ms apart
    records, t = [], 100.0
    for seqs, gap in [(2, 0.02)] * 10 + [(6, 0.05)] * 10:
        records.append(step(t, seqs))
        t += gap
    records.append(step(t, 6))  # closes the last gap
    load = recent_load(records, now=t)
    assert load.num_steps == 20
    assert load.stream_gap_s == pytest.approx((10 * 2 * 0.02 + 10 * 6 * 0.05) / (10 * 2 + 10 * 6))
    assert load.decode_seqs == pytest.approx((10 * 0.02 * 2 + 10 * 0.05 * 6) / (10 * 0.02 + 10 * 0.05))


def test_steps_that_prefill_are_left_out():
    records = [step(10.0 + 0.02 * i, 4, prefill=256 if i % 2 else 0) for i in range(4 * MIN_STEPS + 1)]
    load = recent_load(records, now=records[-1].start_time)
    assert load.num_steps == 2 * MIN_STEPS and load.stream_gap_s == pytest.approx(0.02)


def test_old_steps_pauses_and_prefill_only_steps_are_left_out():
    old = [step(0.0 + 0.01 * i, 1) for i in range(50)]
    now = 100.0
    recent = [step(now - 1.0 + 0.1 * i, 3 if i % 2 else 0) for i in range(2 * MIN_STEPS + 1)]
    paused = [step(now + 5.0, 3)]  # 3.4 s after the last: an engine that stopped, not a gap
    load = recent_load(old + recent + paused, now=now + 5.0, window_s=WINDOW_S)
    assert load.stream_gap_s == pytest.approx(0.1) and load.decode_seqs == pytest.approx(3.0)
    assert load.num_steps == MIN_STEPS
    assert recent_load(recent[:MIN_STEPS], now=now) is None  # too few decoding steps
    assert recent_load(old, now=now) is None  # all older than the window


def test_the_time_after_a_streams_last_token_is_no_gap_of_its():
    # one stream at a time: 5 decode steps 20 ms apart, the last its final token, then
    # 0.5 s idle until the next request; two streams where one ends count the other only
    records, t = [], 100.0
    for _ in range(3):
        for i in range(5):
            records.append(step(t, 1, finished=int(i == 4)))
            t += 0.02
        t += 0.5
    records += [step(t, 2, finished=1), step(t + 0.03, 1)]
    load = recent_load(records, now=t + 0.03)
    assert load.num_steps == 3 * 4 + 1
    assert load.stream_gap_s == pytest.approx((12 * 0.02 + 0.03) / 13)
    assert load.decode_seqs == pytest.approx(1.0)


def test_an_engine_that_decoded_reports_its_recent_gap(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    for i, prompt in enumerate(random_prompts([20, 30, 40], seed=3)):
        engine.add_request(f"r{i}", prompt, greedy(MIN_STEPS + 6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert 0 < stats["recent_stream_gap_s"] < 1.0 and 1.0 <= stats["recent_decode_seqs"] <= 3.0
    load = from_stats("d1", "decode", stats)
    assert load.recent_gap_s == stats["recent_stream_gap_s"]


def test_an_engine_idle_between_requests_reports_the_gap_its_streams_saw(make_engine):
    engine = make_engine()
    for i, prompt in enumerate(random_prompts([12, 16, 20], seed=4)):
        engine.add_request(f"r{i}", prompt, greedy(6, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        time.sleep(1.0)  # idle: no stream waits through it
    decoding = [r for r in engine.step_records if r.num_decode_seqs > 0]
    assert [r.num_finished_streams for r in decoding] == [0, 0, 0, 0, 1] * 3
    gap = engine.stats()["recent_stream_gap_s"]
    assert gap < 0.07  # counting the two idle seconds would read 2 s / 14 gaps or more


COEFFS = StepCoefficients(0.005, 1e-4, 0.0, 5e-4, 0.0)


def test_a_tpot_prediction_leans_on_the_recent_gap():
    req = RequestShape(prompt_len=100, max_tokens=32)
    quiet_now = ReplicaLoad("d1", "decode", COEFFS, num_streams=1, stream_context=200, stream_tokens_left=20)
    cold = predict.local(req, quiet_now, 0).prediction.tpot_s
    assert cold == pytest.approx(replica_steps.decode_step_s(quiet_now, 1, 100))  # no recent past: the state now
    busy_lately = ReplicaLoad("d1", "decode", COEFFS, num_streams=1, stream_context=200, stream_tokens_left=20,
                              recent_gap_s=0.05, recent_decode_seqs=12.0)
    blended = predict.local(req, busy_lately, 0).prediction.tpot_s
    recent_with_own = 0.05 + COEFFS.decode_seq_s
    assert blended == pytest.approx(replica_steps.NOW_WEIGHT * cold + (1 - replica_steps.NOW_WEIGHT) * recent_with_own)
    assert cold < blended < recent_with_own
