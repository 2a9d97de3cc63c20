"""Seed the step-cost fit at start-up, so the router's predictions for this replica are
sensible from its first real request instead of `DEFAULT_COEFFICIENTS`.

Synthetic requests (random token ids) run through the engine in waves, each covering
what the fit must tell apart: short prompts prefill together and decode, a wide batch of
short contexts; a long prompt and its half prefill beside them a step apart (chunks of
several sizes, whole and partial, some at a context); then the two long ones decode on
their own, a narrow batch of long contexts. The long prompt grows fourfold from wave to
wave, from four blocks up to min(max_num_batched_tokens, max_model_len / 2), while the
next wave is expected to end inside the time budget (the last one's time scaled by its
tokens: a CPU stops early, a GPU runs them all). A first request only wakes the model up
(lazy initialisation, allocator growth) and is not learned from.

Afterwards the engine looks untouched: no requests, every block free, nothing of the
warm-up in the prefix cache (it runs with prefix caching off), the counters as they
were, no step records; only its cost models have learned.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.cost_model import StepCoefficients, StepCostFit
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import DEFAULT_YIELD_TOKENS
from workers.engine.step_cost import StepCostModel

if TYPE_CHECKING:
    from workers.engine.llm_engine import LLMEngine

BUDGET_S = 1.5  # a wave expected to end past this (since the start) is not run
NUM_SHORT = 8  # short prompts per wave
SHORT_MAX_TOKENS = 6
LONG_MAX_TOKENS = 10  # the long prompts outlive the short ones, so decode alone last
LONG_AT_STEP = 3  # the short ones decode alone before


@dataclass(frozen=True)
class WarmupRequest:
    at_step: int  # added before this step of its wave
    prompt_len: int
    max_tokens: int


def warmup(engine: LLMEngine, budget_s: float = BUDGET_S, seed: int = 0) -> StepCoefficients:
    """Run the warm-up on an idle engine (`LLMEngine.warmup` holds its lock); returns
    the seeded coefficients."""
    if engine.has_unfinished_requests() or engine.reservations:
        raise RuntimeError("the warm-up needs an idle engine")
    t0 = time.perf_counter()
    counters = _Counters.of(engine)
    caching, engine.block_manager.enable_prefix_caching = engine.block_manager.enable_prefix_caching, False
    try:
        _run(engine, [WarmupRequest(0, engine.layout.block_size, 2)], seed)  # wakes the model up
        _forget_costs(engine)
        last_tokens = last_s = 0.0
        for i, long_len in enumerate(long_prompt_lens(engine)):
            wave = wave_plan(engine.layout.block_size, long_len)
            tokens = sum(r.prompt_len + r.max_tokens for r in wave)
            if i and time.perf_counter() - t0 + last_s * tokens / last_tokens > budget_s:
                break
            started = time.perf_counter()
            _run(engine, wave, seed + 1 + i)
            last_tokens, last_s = tokens, time.perf_counter() - started
        engine.cost_fit.anchor()  # the shape stays pinned where live windows cannot tell it
        return engine.cost_fit.fit()
    except BaseException:
        _abort_all(engine)
        raise
    finally:
        engine.block_manager.enable_prefix_caching = caching
        counters.restore(engine)
        engine.step_records.clear()


def long_prompt_lens(engine: LLMEngine) -> list[int]:
    """Four blocks, x4 a wave, up to the longest prompt worth learning from (one full
    chunk, half the context) that the pool holds with the rest of its wave."""
    block_size = engine.layout.block_size
    longest = min(engine.scheduler.max_num_batched_tokens, engine.runner.max_model_len // 2,
                  engine.block_manager.num_blocks * block_size // 3 - NUM_SHORT * 2 * block_size)
    lens = []
    n = 4 * block_size
    while n < longest:
        lens.append(n)
        n *= 4
    return [*lens, max(1, longest)]


def wave_plan(block_size: int, long_len: int) -> list[WarmupRequest]:
    """Short prompts of one to two blocks at once; a few steps later the long prompt,
    and its half a step after it."""
    shorts = [WarmupRequest(0, block_size + i * block_size // NUM_SHORT, SHORT_MAX_TOKENS)
              for i in range(NUM_SHORT)]
    return [*shorts, WarmupRequest(LONG_AT_STEP, long_len, LONG_MAX_TOKENS),
            WarmupRequest(LONG_AT_STEP + 1, max(1, long_len // 2), LONG_MAX_TOKENS)]


def _run(engine: LLMEngine, plan: list[WarmupRequest], seed: int) -> None:
    """Add each request at its step; step until all have finished."""
    rng = random.Random(seed)
    vocab_size = min(engine.runner.model.config.vocab_size, len(engine.tokenizer))  # ids that detokenize
    plan = sorted(plan, key=lambda r: r.at_step)
    num_added = step = 0
    while num_added < len(plan) or engine.has_unfinished_requests():
        while num_added < len(plan) and plan[num_added].at_step <= step:
            r = plan[num_added]
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, seed=rng.randrange(1 << 30))
            engine.add_request(f"warmup-{seed}-{num_added}", [rng.randrange(vocab_size) for _ in range(r.prompt_len)],
                               params)
            num_added += 1
        engine.step()
        step += 1


def _abort_all(engine: LLMEngine) -> None:
    """A failed warm-up leaves no request behind (nor its outputs, reported by a step)."""
    for request_id in {seq.request_id for seq in engine.requests.values()}:
        engine.abort_request(request_id)
    engine.step()


def _forget_costs(engine: LLMEngine) -> None:
    """The waking wave's steps are slow for reasons no real step shares: unlearn them."""
    engine.step_cost, engine.cost_fit = StepCostModel(), StepCostFit()
    engine.scheduler.yield_tokens = DEFAULT_YIELD_TOKENS
    engine.step_records.clear()


@dataclass(frozen=True)
class _Counters:
    """What `stats()` counts, to put back as it was before the warm-up."""

    num_queried_tokens: int
    num_hit_tokens: int
    num_preemptions: int
    num_background_requests: int
    num_prompt_tokens_computed: int
    step_seconds: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, engine: LLMEngine) -> _Counters:
        bm = engine.block_manager
        return cls(bm.num_queried_tokens, bm.num_hit_tokens, engine.scheduler.num_preemptions,
                   engine.num_background_requests, engine.num_prompt_tokens_computed,
                   tuple(engine.step_seconds.items()))

    def restore(self, engine: LLMEngine) -> None:
        bm = engine.block_manager
        bm.num_queried_tokens, bm.num_hit_tokens = self.num_queried_tokens, self.num_hit_tokens
        engine.scheduler.num_preemptions = self.num_preemptions
        engine.num_background_requests = self.num_background_requests
        engine.num_prompt_tokens_computed = self.num_prompt_tokens_computed
        engine.step_seconds = dict(self.step_seconds)
