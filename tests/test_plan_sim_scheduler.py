"""The simulator's aggregate engine against the real `Scheduler` and `BlockManager`,
driven with the same step times on small traces: the same composition of every step
(prompt tokens, decode sequences) and the same step at which each request finishes,
through chunked prefill, the seat limit, background prefills and preemption."""

from __future__ import annotations

import pytest

from cluster.plan.sim.engine import SimEngine
from cluster.plan.sim.events import EventQueue
from cluster.plan.sim.sequence import SimSeq
from tests.plan_sim_support import Finishes, calibration
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence

# (arrival step, prompt length, output length, background chunk or None for a foreground prompt)
Trace = list[tuple[int, int, int, int | None]]


def run_real(trace: Trace, limits: dict) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Step the real scheduler; a step's work is applied as `LLMEngine._run` applies it."""
    manager = BlockManager(limits["num_kv_blocks"], limits["block_size"], enable_prefix_caching=False)
    scheduler = Scheduler(manager, limits["max_num_seqs"], limits["max_num_batched_tokens"])
    pending = sorted(enumerate(trace), key=lambda x: x[1][0])
    compositions, finished, step = [], {}, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, output_len, chunk) = pending.pop(0)
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, yield_to_decode=chunk is not None,
                                    prefill_chunk_tokens=chunk)
            scheduler.add(Sequence(f"r{i}", [1 + i] * prompt_len, params, seed=0))
        batch = scheduler.schedule()
        if batch:
            decodes = sum(1 for s in batch if s.seq.is_decoding)
            compositions.append((sum(s.num_new_tokens for s in batch if not s.seq.is_decoding), decodes))
        sampling = [s.seq for s in batch if s.needs_sample]
        for s in batch:
            s.seq.num_computed_tokens = s.end
        for seq in sampling:
            seq.output_token_ids.append(0)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                finished[int(seq.request_id[1:])] = len(compositions) - 1
                scheduler.finish(seq, "length")
        step += 1
    return compositions, finished


def run_sim(trace: Trace, limits: dict) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Every step costs 1 s (the step model's fixed cost alone), so step k ends at k + 1;
    a request arriving before step k starts is added at k - 0.5, cutting a run of decode
    steps (one event for several steps) where the real engine would admit it."""
    events, finishes = EventQueue(), Finishes()
    cal = calibration(fixed_s=1.0, prefill_token_s=0.0, decode_seq_s=0.0, enable_prefix_caching=False, **limits)
    engine = SimEngine("d", "decode", cal.limits, cal.step.coefficients(), events.schedule, finishes)
    engine.trace = compositions = []
    for i, (at_step, prompt_len, output_len, chunk) in enumerate(trace):
        seq = SimSeq(i, 0, prompt_len, output_len, background=chunk is not None, chunk_tokens=chunk)
        events.schedule(max(0.0, at_step - 0.5), lambda t, s=seq: engine.add(s, t))
    events.run(until=lambda: len(finishes.finished) == len(trace))
    return compositions, {i: round(t) - 1 for i, t in finishes.finished.items()}


LIMITS = dict(block_size=4, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)

TRACES = {
    "decodes first, then chunks of a long prompt": (
        [(0, 8, 12, None), (0, 6, 10, None), (2, 100, 5, None), (3, 20, 8, None), (9, 7, 3, None)], LIMITS),
    "the seat limit queues the fifth request": (
        [(0, 5, 6, None)] * 5 + [(1, 40, 4, None)], LIMITS),
    "a background prefill takes its chunk while streams decode": (
        [(0, 6, 30, None), (0, 6, 30, None), (1, 90, 4, 5), (4, 12, 6, None)], LIMITS),
    "preemption when blocks run out, recompute later": (
        [(0, 12, 20, None), (0, 12, 20, None), (1, 12, 20, None)], dict(LIMITS, num_kv_blocks=14)),
    "a background request is preempted before earlier and later foreground ones": (
        [(0, 10, 25, None), (0, 30, 25, 6), (2, 10, 25, None), (3, 10, 25, None)], dict(LIMITS, num_kv_blocks=24)),
    "long foreground prompts keep coming: a background prefill still gets its chunk": (
        [(0, 6, 40, None), (1, 60, 5, 4), (1, 70, 2, None), (2, 70, 2, None), (3, 70, 2, None), (5, 70, 2, None),
         (7, 70, 2, None)], dict(LIMITS, max_num_seqs=8)),
    "many requests over a tight pool, preempting": (
        [(i // 2, 9 + 3 * (i % 4), 5 + i % 7, None) for i in range(14)], dict(LIMITS, num_kv_blocks=16)),
}


@pytest.mark.parametrize("name", list(TRACES))
def test_the_aggregate_engine_steps_as_the_real_scheduler(name):
    trace, limits = TRACES[name]
    real_steps, real_finished = run_real(trace, limits)
    sim_steps, sim_finished = run_sim(trace, limits)
    assert sim_steps == real_steps
    assert sim_finished == real_finished
    order = sorted(real_finished, key=lambda i: (real_finished[i], i))
    assert order == sorted(sim_finished, key=lambda i: (sim_finished[i], i))


def test_the_preemption_trace_preempts_in_both():
    trace, limits = TRACES["preemption when blocks run out, recompute later"]
    manager = BlockManager(limits["num_kv_blocks"], limits["block_size"], enable_prefix_caching=False)
    assert manager.num_blocks * limits["block_size"] < sum(p + o for _, p, o, _ in trace)
    events = EventQueue()
    cal = calibration(fixed_s=1.0, prefill_token_s=0.0, decode_seq_s=0.0, enable_prefix_caching=False, **limits)
    engine = SimEngine("d", "decode", cal.limits, cal.step.coefficients(), events.schedule, Finishes())
    for i, (at_step, prompt_len, output_len, _) in enumerate(trace):
        events.schedule(max(0.0, at_step - 0.5), lambda t, s=SimSeq(i, 0, prompt_len, output_len): engine.add(s, t))
    events.run(until=lambda: False)
    assert engine.num_preemptions > 0
    assert engine.free_blocks == limits["num_kv_blocks"]


def test_decode_only_steps_run_as_one_event_and_arrivals_cut_the_run():
    """Three streams decode 60 steps in a few events; a prompt arriving mid-run is
    admitted at the next step boundary, as `run_real` admits it; a sixth request waits
    for a seat without breaking the runs into single steps."""
    trace: Trace = [(0, 8, 60, None)] * 3 + [(12, 20, 3, None), (13, 30, 4, None), (14, 9, 5, None)]
    events, finishes = EventQueue(), Finishes()
    cal = calibration(fixed_s=1.0, prefill_token_s=0.0, decode_seq_s=0.0, enable_prefix_caching=False, **LIMITS)
    engine = SimEngine("d", "decode", cal.limits, cal.step.coefficients(), events.schedule, finishes)
    for i, (at_step, prompt_len, output_len, _) in enumerate(trace):
        events.schedule(max(0.0, at_step - 0.5), lambda t, s=SimSeq(i, 0, prompt_len, output_len): engine.add(s, t))
    events.run(until=lambda: len(finishes.finished) == len(trace))
    assert list(engine.step_ends) == [float(k + 1) for k in range(engine.step)]
    assert events.num_events <= engine.step / 3
    assert run_sim(trace, LIMITS) == run_real(trace, LIMITS)
