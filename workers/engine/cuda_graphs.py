"""Decode steps replayed from captured CUDA graphs, one graph per (batch, width) bucket.

A decode step is the same kernels every time, only its inputs change, and on a GPU a
small model's step is dominated by launching them from Python. So a step of `n` decoding
sequences whose longest context needs `b` blocks runs in the graph of the smallest batch
bucket >= n and width bucket >= b: its static buffers are refilled (padding rows repeat
row 0's K/V into row 0's slot and attend one key, so they never change the cache), the
graph is replayed and its first `n` logits are read. The width is bucketed too (powers
of two) so the captured attention reads at most twice the longest context, not
`max_model_len` for every row. Graphs are captured on first use, with the step's real
inputs, so the untimed warm-up run before a capture is that step computed eagerly.

Anything else runs eagerly: prompt chunks, batches above the largest bucket, steps that
export KV or want prompt logprobs. `Capture` is injected so CPU tests exercise all of it
but `torch.cuda.graph` itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.attention import StaticDecode

log = logging.getLogger(__name__)
MIN_WIDTH_BLOCKS = 16
StepFn = Callable[[], torch.Tensor]  # runs the model on the static buffers, returns logits [B, vocab]
Capture = Callable[[StepFn], tuple[Callable[[], None], torch.Tensor]]  # -> (replay, static logits)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_num_seqs`, then `max_num_seqs` itself."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return (*buckets, max_num_seqs)


def smallest_at_least(value: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= value), None)


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths: powers of two from `MIN_WIDTH_BLOCKS`, then `max_blocks`."""
    widths = [w for w in (MIN_WIDTH_BLOCKS << i for i in range(max_blocks.bit_length())) if w < max_blocks]
    return (*widths, max_blocks)


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step on the host: per sequence its token, position, new slot, context."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


@dataclass
class DecodeBuffers:
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    attention: StaticDecode

    @classmethod
    def allocate(cls, batch: int, width: int, block_size: int, device: torch.device) -> DecodeBuffers:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        mask = torch.zeros(batch, 1, 1, width * block_size, dtype=torch.bool, device=device)
        return cls(longs(batch), longs(batch), StaticDecode(longs(batch), longs(batch), longs(batch, width), mask))

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    def fill(self, inputs: DecodeInputs) -> None:
        """Copy `inputs` in, padding to the bucket: padding rows take token 0 at position 0,
        write row 0's K/V into row 0's slot and attend key 0 of block 0."""
        pad = self.batch - inputs.num_seqs
        static = self.attention
        width = static.block_table.shape[1]
        num_keys = static.mask.shape[-1]
        table = [t[:width] + [0] * (width - len(t[:width])) for t in inputs.block_tables] + [[0] * width] * pad
        lens = torch.tensor(inputs.context_lens + [1] * pad)
        host = [
            (self.input_ids, torch.tensor(inputs.token_ids + [0] * pad)),
            (self.positions, torch.tensor(inputs.positions + [0] * pad)),
            (static.slot_mapping, torch.tensor(inputs.slots + [inputs.slots[0]] * pad)),
            (static.write_rows, torch.tensor(list(range(inputs.num_seqs)) + [0] * pad)),
            (static.block_table, torch.tensor(table)),
            (static.mask, (torch.arange(num_keys)[None, :] < lens[:, None])[:, None, None, :]),
        ]
        for buffer, values in host:
            buffer.copy_(values, non_blocking=True)


@dataclass
class CapturedStep:
    buffers: DecodeBuffers
    replay: Callable[[], None]
    logits: torch.Tensor  # [B, vocab], rewritten by each replay


class DecodeGraphs:
    """Captured decode steps by (batch bucket, width bucket); `run` returns None to mean
    "run this step eagerly"."""

    def __init__(self, step: Callable[[DecodeBuffers], torch.Tensor], capture: Capture, max_num_seqs: int,
                 max_blocks: int, block_size: int, device: torch.device) -> None:
        self.step, self.capture = step, capture
        self.batches, self.widths = batch_buckets(max_num_seqs), width_buckets(max_blocks)
        self.block_size, self.device = block_size, device
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        self.failed = False  # a capture raised: every step runs eagerly from then on

    def bucket(self, inputs: DecodeInputs) -> tuple[int, int] | None:
        if self.failed:
            return None
        batch = smallest_at_least(inputs.num_seqs, self.batches)
        width = smallest_at_least(-(-max(inputs.context_lens) // self.block_size), self.widths)
        return None if batch is None or width is None else (batch, width)

    def run(self, inputs: DecodeInputs) -> torch.Tensor | None:
        """Logits `[num_seqs, vocab]` (a copy, in float32) or None when no bucket fits."""
        key = self.bucket(inputs)
        if key is None:
            return None
        captured = self.captured.get(key)
        if captured is None:
            captured = self._capture(key, inputs)
            if captured is None:
                return None
        else:
            captured.buffers.fill(inputs)
        captured.replay()
        return captured.logits[:inputs.num_seqs].to(torch.float32, copy=True)

    def _capture(self, key: tuple[int, int], inputs: DecodeInputs) -> CapturedStep | None:
        """Capture with `inputs` already in the buffers (the warm-up run is then a correct
        eager step, and so is anything it wrote to the cache before a failure)."""
        buffers = DecodeBuffers.allocate(*key, self.block_size, self.device)
        buffers.fill(inputs)
        try:
            replay, logits = self.capture(lambda: self.step(buffers))
        except RuntimeError:  # the model does something a graph cannot hold: keep serving, eagerly
            log.warning("decode step (batch, width) %s could not be captured; decoding eagerly from now on",
                        key, exc_info=True)
            self.failed = True
            return None
        self.captured[key] = CapturedStep(buffers, replay, logits)
        return self.captured[key]


def eager_capture(step: StepFn) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for `cuda_capture` where there is no GPU: "replay" reruns the step into
    the same output tensor, so everything around the graph is exercised."""
    logits = step()
    return lambda: logits.copy_(step()), logits


def cuda_capture(pool: object | None = None) -> Capture:
    """Capture on a side stream after one warm-up run (which lazily initialises cuBLAS and
    friends outside the graph); every graph shares `pool`'s memory. Thread-local capture:
    a transport thread may write imported KV into the cache while a step is captured."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(step: StepFn) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = step()
        return graph.replay, logits

    return capture
