"""Priority, preemption order, abort, and limits of the scheduler, on the real engine."""

from __future__ import annotations

import pytest

from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine import SamplingParams


def finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_higher_priority_is_admitted_first_fcfs_within_a_priority(make_engine):
    engine = make_engine(max_num_seqs=1)
    for request_id, priority in [("low", 0), ("high-1", 5), ("mid", 2), ("high-2", 5)]:
        engine.add_request(request_id, random_prompts([20])[0], greedy(3, priority=priority, ignore_eos=True))
    assert finish_order(engine) == ["high-1", "high-2", "mid", "low"]


def test_lowest_priority_is_preempted_when_blocks_run_out(make_engine):
    engine = make_engine(num_kv_blocks=10, block_size=4)  # 40 slots for two sequences of ~25 tokens each
    engine.add_request("important", random_prompts([12], seed=1)[0], greedy(20, priority=1, ignore_eos=True))
    engine.add_request("background", random_prompts([12], seed=2)[0], greedy(20, ignore_eos=True))
    while engine.stats()["num_preemptions"] == 0:
        engine.step()
        engine.check_integrity()
    assert [s.request_id for s in engine.scheduler.running] == ["important"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["background"]
    assert finish_order(engine) == ["important", "background"]


def test_preemptions_reach_the_workers_counter_through_stats(make_engine):
    from workers.metrics import WorkerMetrics

    engine = make_engine(num_kv_blocks=10, block_size=4)
    for i in range(2):
        engine.add_request(f"r{i}", random_prompts([12], seed=i)[0], greedy(20, ignore_eos=True))
    metrics = WorkerMetrics("tiny", "decode", "r1")
    while engine.has_unfinished_requests():
        engine.step()
        metrics.update_from_stats(engine.stats())
    num_preemptions = engine.stats()["num_preemptions"]
    assert num_preemptions > 0
    assert metrics.num_preemptions.labels("tiny", "decode", "r1")._value.get() == num_preemptions


def test_first_output_says_how_long_the_prompt_waited_for_its_first_step(make_engine):
    """Once per sequence prefilled here: not for its forks, nor again after a preemption."""
    engine = make_engine(max_num_seqs=2, num_kv_blocks=10, block_size=4)  # 40 slots, 2 seats
    for i, request_id in enumerate(("first", "second")):  # run out of blocks together: one is preempted
        engine.add_request(request_id, random_prompts([12], seed=i)[0], greedy(20, ignore_eos=True))
    engine.add_request("forks", random_prompts([4], seed=2)[0], SamplingParams(n=2, max_tokens=2))
    reported = []
    while engine.has_unfinished_requests():
        reported += [(o.request_id, o.queue_s) for o in engine.step() if o.queue_s is not None]
    assert engine.stats()["num_preemptions"] > 0
    waits = dict(reported)
    assert len(reported) == len(waits) == 3
    assert 0 <= waits["first"] < waits["forks"]  # `forks` waited for two free seats


def test_abort_frees_blocks_at_once_in_every_state(make_engine):
    engine = make_engine(max_num_seqs=1, enable_prefix_caching=False)
    engine.add_request("running", random_prompts([40])[0], greedy(50, ignore_eos=True))
    engine.add_request("waiting", random_prompts([40])[0], greedy(50, ignore_eos=True))
    engine.step()
    engine.step()
    total = engine.stats()["kv_blocks_total"]
    assert engine.stats()["kv_blocks_free"] == total - 3
    assert engine.abort_request("running")
    assert engine.stats()["kv_blocks_free"] == total
    assert engine.abort_request("waiting") and not engine.abort_request("unknown")
    engine.check_integrity()
    outs = engine.step()
    assert {(o.request_id, o.finish_reason, o.finished) for o in outs} == {
        ("running", "abort", True), ("waiting", "abort", True)}
    assert len(next(o for o in outs if o.request_id == "running").token_ids) == 2
    assert not engine.has_unfinished_requests()


def test_stream_of_step_outputs_reports_each_token_once(make_engine):
    engine = make_engine()
    engine.add_request("a", random_prompts([10])[0], greedy(6, ignore_eos=True))
    new_ids, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            new_ids += out.new_token_ids
            last = out
    assert last.finished and last.finish_reason == "length" and new_ids == last.token_ids


def test_stop_token_ends_the_request_and_is_kept(make_engine):
    prompt = random_prompts([2])[0]
    tokens = make_engine().generate([prompt], greedy(24))[0].token_ids
    stop_id = tokens[5]
    out = make_engine().generate([prompt], greedy(24, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[:tokens.index(stop_id) + 1]


def test_requests_that_cannot_fit_are_refused_up_front(make_engine):
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV pool"):
        engine.add_request("big", random_prompts([60])[0], greedy(10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], greedy(1))
    engine.add_request("dup", [1, 2], greedy(1))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1, 2], greedy(1))
    finish_order(engine)


def test_stats_and_step_records(make_engine):
    engine = make_engine(max_num_batched_tokens=32)
    engine.generate(random_prompts([50, 3]), [greedy(4, ignore_eos=True), greedy(4, ignore_eos=True)])
    stats = engine.stats()
    assert {"prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_blocks_free",
            "kv_blocks_total", "num_running", "num_waiting"} <= stats.keys()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 512
    records = list(engine.step_records)
    assert sum(r.num_prefill_tokens for r in records) == 53
    assert sum(r.num_decode_seqs for r in records) == 6  # 3 decode steps after each first token
    assert all(r.step_time_s > 0 for r in records)


def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine):
    prompts = random_prompts([5, 30, 17], seed=11)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = make_engine().generate(prompts[:1], params)[0].token_ids
    batched = make_engine(max_num_batched_tokens=8).generate(prompts, params)[0].token_ids
    assert alone == batched


def test_decoding_streams_are_scheduled_before_prefill_chunks(make_engine):
    """A long prompt that sorts first (higher priority) takes only the budget the running
    streams leave: every step of its chunked prefill still advances every stream."""
    engine = make_engine(max_num_batched_tokens=32)
    streams = random_prompts([5, 7], seed=11)
    for i, prompt in enumerate(streams):
        engine.add_request(f"s{i}", prompt, greedy(40, ignore_eos=True))
    while engine.stats()["num_running"] < 2 or any(
            engine.requests[f"s{i}"].num_uncomputed_tokens > 1 for i in range(2)):
        engine.step()
    long_prompt = random_prompts([300], seed=12)[0]
    engine.add_request("long", long_prompt, greedy(2, ignore_eos=True, priority=1))
    prefill_steps = 0
    while engine.requests["long"].num_computed_tokens < len(long_prompt):
        advanced = {out.request_id for out in engine.step() if out.new_token_ids}
        assert {"s0", "s1"} <= advanced, f"a stream stalled behind the prefill: {advanced}"
        prefill_steps += 1
    assert prefill_steps >= 300 // 32  # it really was chunked around the streams
    while engine.has_unfinished_requests():
        engine.step()


def _run_streams(engine, n: int = 2, max_tokens: int = 60) -> None:
    for i, prompt in enumerate(random_prompts([5, 7, 6][:n], seed=21)):
        engine.add_request(f"s{i}", prompt, greedy(max_tokens, ignore_eos=True))
    while engine.stats()["num_running"] < n or any(
            engine.requests[f"s{i}"].num_uncomputed_tokens > 1 for i in range(n)):
        engine.step()


def test_a_background_prefill_takes_only_yield_tokens_while_streams_decode(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    _run_streams(engine)
    long_prompt = random_prompts([400], seed=22)[0]
    engine.add_request("bg", long_prompt, greedy(2, ignore_eos=True, yield_to_decode=True))
    seq = engine.requests["bg"]
    while seq.num_computed_tokens < len(long_prompt):
        before, cap = seq.num_computed_tokens, engine.scheduler.yield_tokens
        streams_left = [f"s{i}" for i in range(2) if f"s{i}" in engine.requests]
        advanced = {out.request_id for out in engine.step() if out.new_token_ids}
        assert set(streams_left) <= advanced, "a stream stalled behind the background prefill"
        if streams_left:
            assert 0 < seq.num_computed_tokens - before <= cap  # it yields, but it advances
        else:
            assert seq.num_computed_tokens - before == min(64, len(long_prompt) - before)  # full chunks
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_foreground_requests_go_before_a_background_prefill(make_engine):
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=2)
    engine.add_request("bg", random_prompts([300], seed=23)[0], greedy(2, ignore_eos=True, yield_to_decode=True))
    engine.step()  # it started
    engine.add_request("fg", random_prompts([40], seed=24)[0], greedy(2, ignore_eos=True))
    assert finish_order(engine) == ["fg", "bg"]


def test_a_steady_stream_of_long_foreground_prompts_does_not_starve_a_background_prefill(make_engine):
    """Long foreground prompts keep arriving, each filling the step's budget: the
    background prompt, running or still waiting, advances by its chunk every step anyway
    and finishes while they keep coming."""
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=8)
    _run_streams(engine, n=1, max_tokens=400)
    prompts = iter(random_prompts([300] * 40, seed=26))
    for i in range(3):
        engine.add_request(f"fg{i}", next(prompts), greedy(1, ignore_eos=True))
    engine.add_request("bg", random_prompts([200], seed=27)[0], greedy(2, ignore_eos=True, yield_to_decode=True))
    seq, steps, added = engine.requests["bg"], 0, 3
    while "bg" in engine.requests:
        before = seq.num_computed_tokens
        engine.step()
        steps += 1
        assert seq.num_computed_tokens > before or seq.num_uncomputed_tokens <= 1, f"starved at step {steps}"
        while sum(1 for r in engine.requests if r.startswith("fg")) < 3:  # the foreground load never lets up
            engine.add_request(f"fg{added}", next(prompts), greedy(1, ignore_eos=True))
            added += 1
        assert steps < 200
    engine.check_integrity()


def test_a_background_prefill_changes_no_token(make_engine):
    """Greedy output is the same whether the prompt yields to streams or runs alone."""
    prompt = random_prompts([200], seed=25)[0]
    alone = make_engine().generate([prompt], greedy(12))[0].token_ids
    engine = make_engine(max_num_batched_tokens=48)
    _run_streams(engine, 3)
    engine.add_request("bg", prompt, greedy(12, yield_to_decode=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert outputs["bg"] == alone
