"""`pdcluster bench engine --profile`: where one engine step's time goes.

At decode batches (pure-decode steps at one context) and on a prefill step at the chunk
shape, each timed step is split by the engine's own stamps (`LLMEngine.step_phases`):
scheduling, metadata (the runner's call minus the model's forward: attention metadata,
input tensors, logits out), the forward, sampling, output processing, and `other` (the
rest of the `step()` call: step records and the step-cost fits, the lock, collecting
outputs). The engine detokenizes, as a server's does.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from cluster.bench.engine_shapes import (
    ShapeTiming,
    shape_engine,
    time_decode,
    time_prefill,
    warm_up,
)

PHASES = ("schedule", "metadata", "forward", "sample", "output", "other")
NUM_STEPS = 8  # timed per shape, after one untimed


def run_profile(model_dir: Path, chunk_tokens: int, decode_batches: tuple[int, ...], context: int,
                log: Callable[[str], None] = lambda _: None) -> dict:
    """Per shape (`decode_b<batch>_ctx<context>`, `prefill_<chunk>`): the mean step and
    each phase's mean seconds and share of it."""
    engine = shape_engine(str(model_dir), max(decode_batches) * context, chunk_tokens, detokenize=True)
    shapes = {}
    warm_up(engine)
    for batch in decode_batches:
        log(f"profile: decode, batch {batch}, context {context} ...")
        shapes[f"decode_b{batch}_ctx{context}"] = phase_split(time_decode(engine, batch, context, NUM_STEPS))
    log(f"profile: prefill of {chunk_tokens} tokens ...")
    shapes[f"prefill_{chunk_tokens}"] = phase_split(time_prefill(engine, chunk_tokens, max(2, NUM_STEPS // 4)))
    return shapes


def phase_split(timing: ShapeTiming) -> dict:
    """The mean `step()` call and each phase's mean and share of it; `outside_forward`:
    the share of everything but the forward."""
    call_s = statistics.mean(timing.call_s)
    phases = timing.phases
    forward_known = all(p.forward_s is not None for p in phases)
    means = {
        "schedule": statistics.mean(p.schedule_s for p in phases),
        # Without the forward's own stamps (a captured graph), the runner's call counts whole as forward.
        "metadata": statistics.mean(p.metadata_s for p in phases) if forward_known else 0.0,
        "forward": statistics.mean(p.forward_s if forward_known else p.run_s for p in phases),
        "sample": statistics.mean(p.sample_s for p in phases),
        "output": statistics.mean(p.output_s for p in phases),
    }
    means["other"] = max(0.0, call_s - sum(means.values()))
    return {
        "step_s": round(call_s, 6),
        "phases": {name: {"mean_s": round(means[name], 6), "share": round(means[name] / call_s, 4)}
                   for name in PHASES},
        "outside_forward": round(1.0 - means["forward"] / call_s, 4),
        "forward_timed_apart": forward_known,
        "num_steps": len(phases),
    }
