"""The real engine (`LLMEngine`, its scheduler) timed at fixed step shapes.

A decode batch of `batch` sequences at `context` tokens is filled without computing its
prompts: each sequence's prompt KV is imported (`reserve_kv` / `write_kv_layer` /
`commit_kv`, the decode replica's own path) with random values, so the steps that follow
decode the whole batch at that context, exactly as after a prefill elsewhere. The tokens
they produce are meaningless; their time is not. A prefill step at the chunk shape is one
fresh prompt of `chunk_tokens` tokens (no prefix hit, one token sampled).

Times are the engine's own step records (`StepRecord.step_time_s`, `StepPhases`), the
median over the timed steps after one untimed step.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from workers.engine import LLMEngine, SamplingParams
from workers.engine.step_cost import StepPhases

NUM_BYTE_TOKENS = 256  # prompts use byte tokens only, never specials
KV_SCALE = 0.5  # random KV values of about a real cache's size


@dataclass(frozen=True)
class ShapeTiming:
    """The engine's steps at one shape: the median step, and per timed step its phases
    and the wall time of the whole `step()` call (which also keeps the step's records)."""

    step_s: float
    phases: list[StepPhases]
    call_s: list[float]


def shape_engine(model_dir: str, max_tokens: int, chunk_tokens: int, block_size: int = 16,
                 detokenize: bool = False) -> LLMEngine:
    """An engine whose KV pool holds `max_tokens` tokens (plus a few steps per sequence)."""
    num_blocks = max_tokens // block_size + 4096 // block_size
    return LLMEngine(model_dir, block_size=block_size, num_kv_blocks=num_blocks, device="cpu", dtype="float32",
                     max_num_seqs=256, max_num_batched_tokens=chunk_tokens, detokenize=detokenize)


def warm_up(engine: LLMEngine) -> None:
    """A few untimed decode steps: a fresh engine's first steps pay one-time costs (the
    allocator, the thread pool, the step-cost fit's early refits)."""
    time_decode(engine, batch=2, context=64, num_steps=3)


def time_decode(engine: LLMEngine, batch: int, context: int, num_steps: int) -> ShapeTiming:
    """Median pure-decode step of `batch` sequences attending about `context` tokens each."""
    rng = _fresh_prompts()
    tag = f"decode-{batch}-{context}-{time.monotonic_ns()}"
    for i in range(batch):
        import_prompt(engine, f"{tag}-{i}", [rng.randrange(NUM_BYTE_TOKENS) for _ in range(context - 1)],
                      SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # reports the imported first tokens; runs no batch
    return _timed_steps(engine, num_steps, lambda r: r.num_decode_seqs == batch and not r.num_prefill_tokens)


def time_prefill(engine: LLMEngine, chunk_tokens: int, num_steps: int) -> ShapeTiming:
    """Median step that computes one fresh prompt of `chunk_tokens` tokens whole."""
    rng = _fresh_prompts()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(num_steps + 1):
        engine.add_request(f"prefill-{time.monotonic_ns()}-{i}",
                           [rng.randrange(NUM_BYTE_TOKENS) for _ in range(chunk_tokens)], params)
    return _timed_steps(engine, num_steps, lambda r: r.num_prefill_tokens == chunk_tokens and not r.num_decode_seqs)


def import_prompt(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    """A request that decodes as if its prompt had been prefilled on another replica."""
    reservation = engine.reserve_kv(request_id, prompt)
    if reservation is None:
        raise RuntimeError(f"the KV pool has no room for a {len(prompt)}-token prompt")
    shape = engine.layout.layer_shape(reservation.num_blocks_to_receive)
    kv = (torch.randn(shape) * KV_SCALE).to(getattr(torch, engine.layout.dtype))
    for layer_idx in range(engine.layout.num_layers):
        engine.write_kv_layer(reservation, layer_idx, kv)
    engine.commit_kv(reservation, request_id, params, first_token_id=prompt[-1])


def _fresh_prompts() -> random.Random:
    """Prompts no earlier call made: a prefix-cache hit would shorten the chunk computed."""
    return random.Random(time.monotonic_ns())


def _timed_steps(engine: LLMEngine, num_steps: int, counts) -> ShapeTiming:
    """Step until every request ends; the first `num_steps` steps after the first that
    `counts` (by its `StepRecord`) are timed."""
    timed: list[tuple[float, StepPhases, float]] = []
    num_seen = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        call_s = time.perf_counter() - start
        record, phases = engine.step_records[-1], engine.step_phases[-1]
        if counts(record):
            num_seen += 1
            if 1 < num_seen <= num_steps + 1:
                timed.append((record.step_time_s, phases, call_s))
    if not timed:
        raise RuntimeError("no step had the shape asked for")
    return ShapeTiming(statistics.median(t[0] for t in timed), [t[1] for t in timed], [t[2] for t in timed])
