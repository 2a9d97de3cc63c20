"""Time the model runner's decode step alone: `batch` sequences, each `context` tokens
deep, one new token each, no scheduler, sampler or output processing around it.

The block tables are laid out the way a busy engine leaves them: each sequence's prompt
in one run of consecutive blocks, then (with `fragmented`) its generated tail in blocks
handed out one at a time, interleaved with the other sequences'. The KV is random; the
step's cost does not depend on its values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq
from workers.engine.sequence import Sequence

TAIL_TOKENS = 128  # generated tokens whose blocks interleave with the other sequences'


@dataclass(frozen=True)
class DecodeTiming:
    batch: int
    context: int
    step_ms: float  # median wall time over the timed steps
    cpu_ms: float  # median process CPU time (all threads): steadier than wall on a shared machine
    num_steps: int


def block_tables(batch: int, context: int, block_size: int, fragmented: bool) -> list[list[int]]:
    """Per sequence, block ids for `context + 1` tokens (prompt runs, then interleaved tails)."""
    num_blocks = -(-(context + 1) // block_size)
    tail = min(num_blocks - 1, TAIL_TOKENS // block_size) if fragmented else 0
    head = num_blocks - tail
    tables = [list(range(i * head, (i + 1) * head)) for i in range(batch)]
    next_id = batch * head
    for _ in range(tail):
        for table in tables:
            table.append(next_id)
            next_id += 1
    return tables


def decode_batch(batch: int, context: int, block_size: int, fragmented: bool = True) -> list[ScheduledSeq]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, table in enumerate(block_tables(batch, context, block_size, fragmented)):
        seq = Sequence(f"probe-{i}", [(7 * i + j) % 256 for j in range(context + 1)], params, seed=0)
        seq.block_ids, seq.num_computed_tokens = table, context
        seqs.append(ScheduledSeq(seq, 1))
    return seqs


def blocks_needed(batch: int, context: int, block_size: int) -> int:
    return max(max(t) for t in block_tables(batch, context, block_size, True)) + 1


def time_decode(runner: ModelRunner, batch: int, context: int, num_steps: int = 5,
                fragmented: bool = True) -> DecodeTiming:
    """Median wall time of `runner.run` on one decode step (one untimed warm-up step)."""
    scheduled = decode_batch(batch, context, runner.layout.block_size, fragmented)
    walls, cpus = [], []
    for _ in range(num_steps + 1):
        _sync(runner.device)
        wall, cpu = time.perf_counter(), time.process_time()
        runner.run(scheduled, [])
        _sync(runner.device)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return DecodeTiming(batch, context, _median_ms(walls[1:]), _median_ms(cpus[1:]), num_steps)


def _median_ms(seconds: list[float]) -> float:
    return round(sorted(seconds)[len(seconds) // 2] * 1e3, 3)


def randomize_kv(runner: ModelRunner, seed: int = 0) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for layer in runner.kv_cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=generator, dtype=layer.dtype).to(layer.device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
