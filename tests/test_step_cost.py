"""`StepCostModel`: the background prefill's chunk sized from the engine's step records."""

from __future__ import annotations

import pytest

from tests.engine_support import make_engine_fixture  # noqa: F401
from workers.engine.step_cost import MIN_PREFILL_TOKENS, StepCostModel, StepRecord


def record(step_s: float, prefill_tokens: int, decode_seqs: int) -> StepRecord:
    return StepRecord(start_time=0.0, step_time_s=step_s, num_prefill_tokens=prefill_tokens,
                      num_decode_seqs=decode_seqs, num_context_tokens=prefill_tokens + decode_seqs,
                      num_running=decode_seqs + 1, num_waiting=0)


def test_the_default_holds_until_both_costs_are_known():
    model = StepCostModel()
    assert model.yield_tokens(32, 512) == 32
    model.observe(record(0.040, 0, 2))
    assert model.yield_tokens(32, 512) == 32
    assert model.yield_tokens(32, 16) == 16  # never above the step budget


@pytest.mark.parametrize("decode_s, token_s, expected", [(0.040, 0.002, 10), (0.060, 0.0001, 300),
                                                          (0.001, 0.01, 1)])
def test_yield_tokens_cost_half_a_decode_step(decode_s, token_s, expected):
    model = StepCostModel()
    for _ in range(50):  # converged averages
        model.observe(record(decode_s, 0, 3))
        model.observe(record(token_s * 512, 512, 0))
    assert model.yield_tokens(32, 512) == pytest.approx(expected, abs=1)


def test_the_marginal_cost_beside_streams_sizes_the_chunk():
    """Small chunks beside streams cost more per token than big chunks: the model sizes
    the background chunk from what tokens actually added to decoding steps."""
    model = StepCostModel()
    for _ in range(50):
        model.observe(record(0.020, 0, 2))  # decode step 20 ms
        model.observe(record(0.512, 512, 0))  # 1 ms per token in a big chunk
        model.observe(record(0.040, 10, 2))  # but 10 tokens beside streams add 20 ms: 2 ms each
    assert model.marginal_token_s == pytest.approx(0.002, rel=0.01)
    assert model.yield_tokens(32, 512) == 5  # half a decode step: 10 ms / 2 ms
    model.observe(record(0.045, 1, 2))  # a prompt's last token beside the streams
    assert model.marginal_token_s < 0.003  # weighs as one token (a per-step average: 6.6 ms)


def test_short_chunks_and_idle_steps_teach_nothing():
    model = StepCostModel()
    model.observe(record(0.5, MIN_PREFILL_TOKENS - 1, 0))  # overhead-dominated
    model.observe(record(0.5, 0, 0))
    assert model.prefill_token_s is None and model.decode_step_s is None


def test_the_engine_sizes_its_scheduler_from_its_records(make_engine):
    from tests.engine_support import greedy, random_prompts

    engine = make_engine(max_num_batched_tokens=128)
    engine.generate(random_prompts([300, 5], seed=3), greedy(8, ignore_eos=True))
    model = engine.step_cost
    assert model.decode_step_s and model.prefill_token_s
    assert engine.scheduler.yield_tokens == model.yield_tokens(32, 128)


def test_step_records_count_prefill_sequences_and_attention_work(make_engine):
    """Budget 32, prompts of 50 and 3 tokens: step 1 computes A[0:32), step 2 A[32:50)
    and B[0:3); each chunk's tokens attend to everything up to its end."""
    from tests.engine_support import greedy, random_prompts

    engine = make_engine(max_num_batched_tokens=32)
    engine.generate(random_prompts([50, 3]), [greedy(2, ignore_eos=True)] * 2)
    first, second, third = list(engine.step_records)[:3]
    assert (first.num_prefill_seqs, first.prefill_attention_work) == (1, 32 * 32)
    assert (second.num_prefill_seqs, second.num_prefill_tokens) == (2, 18 + 3)
    assert second.prefill_attention_work == 18 * 50 + 3 * 3
    assert second.num_context_tokens == 50 + 3
    assert (third.num_prefill_seqs, third.prefill_attention_work, third.num_decode_seqs) == (0, 0, 2)
    assert third.num_context_tokens == 51 + 4
