"""A simulated engine's decode batch as counters: no decoding sequence is touched per step.

Every decoding sequence emits one token a step, so its context at step k is its context
when it joined plus the steps since. The batch keeps only sums from which each step's
work follows: the number of sequences, the sum of (context at join - join step) (the
step's decode context is that plus the batch size times k + 1), a count per block phase
(a sequence needs a new block in the steps where its context is a multiple of the block
size) and a heap of finish steps (lazily cleaned: a preempted sequence's entry is
skipped). A `DecodeRun` is several decode-only steps as one event: they differ only by
the context growing, so their ends follow in closed form.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from cluster.plan.sim.sequence import SimSeq

MAX_RUN_STEPS = 64  # steps one event may cover (a heartbeat reads the counters at the run's start)
_tiebreak = itertools.count()


def num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class DecodeBatch:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[int, SimSeq] = {}
        self._phase = [0] * block_size  # sequences per (join ctx - join step) mod block size
        self._ctx_base = 0  # sum of join ctx - join step
        self._finish_sum = 0
        self._finishes: list[tuple[int, int, SimSeq]] = []  # (finish step, tiebreak, seq)

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, seq: SimSeq) -> bool:
        return id(seq) in self.seqs

    def join(self, seq: SimSeq, step: int, context: int, num_steps: int) -> None:
        """`seq` decodes from `step` for `num_steps` steps, holding `context` tokens of KV."""
        seq.join_step, seq.join_ctx, seq.finish_step = step, context, step + num_steps - 1
        self.seqs[id(seq)] = seq
        offset = context - step
        self._phase[offset % self.block_size] += 1
        self._ctx_base += offset
        self._finish_sum += seq.finish_step
        heapq.heappush(self._finishes, (seq.finish_step, next(_tiebreak), seq))

    def leave(self, seq: SimSeq, k: int, allocated: bool) -> int:
        """Take `seq` out before step `k` ends; the blocks it holds (this step's included
        when `allocated`)."""
        del self.seqs[id(seq)]
        offset = seq.join_ctx - seq.join_step
        self._phase[offset % self.block_size] -= 1
        self._ctx_base -= offset
        self._finish_sum -= seq.finish_step
        return num_blocks(seq.context_at(k) + (1 if allocated else 0), self.block_size) - seq.shared_blocks

    def new_blocks(self, k: int) -> int:
        """Blocks the batch allocates in step `k`."""
        return self._phase[(-k) % self.block_size]

    def context(self, k: int) -> int:
        """Step `k`'s decode context: every sequence's end after its token (as recorded)."""
        return self._ctx_base + len(self.seqs) * (k + 1)

    def tokens_remaining(self, k: int) -> int:
        """Tokens still to come from step `k` on."""
        return self._finish_sum - len(self.seqs) * (k - 1)

    def next_finish(self) -> int | None:
        return self._finishes[0][0] if self._finishes else None

    def finished_by(self, k: int) -> Iterator[SimSeq]:
        """The sequences whose last token step `k` emits (stale heap entries dropped)."""
        finishes = self._finishes
        while finishes and finishes[0][0] <= k:
            _, _, seq = heapq.heappop(finishes)
            if seq.finish_step == k and id(seq) in self.seqs:
                yield seq


@dataclass(frozen=True)
class DecodeRun:
    """Decode-only steps `first`.. `first + num_steps - 1`, started at `start`; step j
    (from 0) lasts `step_s + growth_s * j` (its context grows by the batch every step)."""

    start: float
    first: int
    num_steps: int
    step_s: float
    growth_s: float
    blocks: tuple[int, ...]  # new blocks each step takes, allocated when the run starts

    def end_of(self, j: int) -> float:
        return self.start + (j + 1) * self.step_s + self.growth_s * j * (j + 1) / 2

    def cut(self, num_steps: int) -> DecodeRun:
        return DecodeRun(self.start, self.first, num_steps, self.step_s, self.growth_s, self.blocks[:num_steps])
