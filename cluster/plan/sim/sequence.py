"""One request's share of a simulated engine: what it must compute and emit there.

A `SimSeq` is the simulator's `workers.engine.sequence.Sequence` without token ids: the
prompt tokens to compute (a recompute after preemption adds the tokens it had emitted),
the tokens to emit, its block hashes for the prefix cache, and, once it decodes, where
it joined the batch. A decoding sequence is never touched per step: the engine derives
its context and blocks from the step index (engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class SimSeq:
    owner: Any  # the simulator's request (listeners get the sequence back)
    arrival: int  # FCFS order, as the engine's arrival counter
    prompt_len: int  # tokens to compute before it samples
    output_len: int  # tokens it emits in all (a remote prefill: 1)
    hashes: Sequence[int] = ()  # chained hashes of the prompt's full blocks
    background: bool = False  # `yield_to_decode`: takes only what the streams leave
    chunk_tokens: int | None = None  # a background prefill's chunk in a decoding step
    kv_only: bool = False  # a remote prefill: leaves at its first token, its KV goes elsewhere
    num_computed: int = 0
    num_emitted: int = 0  # tokens emitted before it joined the decode batch (or was preempted)
    shared_blocks: int = 0  # leading blocks served by the prefix cache (not its own)
    owned_blocks: int = 0  # blocks it allocated (prefilling or waiting with imported KV)
    # decoding: the step it joined at, its computed tokens then, the step of its last token
    join_step: int = -1
    join_ctx: int = 0
    finish_step: int = -1
    segments: list[tuple[int, int]] = field(default_factory=list)  # steps whose ends emitted its tokens

    @property
    def num_uncomputed(self) -> int:
        return self.prompt_len - self.num_computed

    @property
    def decoding(self) -> bool:
        return self.join_step >= 0

    @property
    def priority_key(self) -> tuple[bool, int]:
        """The real scheduler's order: foreground first, then FCFS (priority 0 for all)."""
        return (self.background, self.arrival)

    def context_at(self, step: int) -> int:
        """Decoding: tokens with KV before step `step` runs."""
        return self.join_ctx + step - self.join_step

    def emitted_at(self, step: int) -> int:
        """Decoding: tokens emitted before step `step` runs."""
        return self.num_emitted + step - self.join_step
