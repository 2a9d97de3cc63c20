"""One request inside the engine, and what a step reports about it.

There are no prefill or decode phases: a sequence holds `token_ids` (prompt, then
outputs) of which the first `num_computed_tokens` have KV in its blocks, and each step
computes some more. When all of them are computed, the step samples the next token.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.engine.kv_types import KVSink
from workers.engine.output_processor import OutputProcessor
from workers.engine.prefix_hash import ROOT_HASH, hash_block
from workers.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workers.engine.grammar import GuidedMatcher

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    kv_sink: KVSink | None = None  # cleared once the prompt KV was handed over
    processor: OutputProcessor | None = None
    matcher: GuidedMatcher | None = None  # with `params.guided`: the grammar state, per output token
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens the last admission found in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.monotonic)  # when it entered the engine
    # When a step first scheduled its prompt here (None: not yet, or its KV came from elsewhere).
    first_scheduled_time: float | None = None
    # With `params.prompt_logprobs`: the prompt's entries computed so far ([None] for the
    # first token, then one per computed position), until the first output reports them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's `params.num_sequences` this is (children fork from 0)
    cumulative_logprob: float = 0.0  # of its generated tokens under the raw logits (for best_of)
    _block_hashes: list[int] = field(default_factory=list, repr=False)

    @property
    def seq_id(self) -> str:
        """The engine's key for this sequence: its request's id, suffixed for a forked one."""
        return self.request_id if self.index == 0 else f"{self.request_id}\x00{self.index}"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def priority_key(self) -> tuple[bool, int, int]:
        """Sorts first whoever is admitted first and preempted last: foreground before
        background (`yield_to_decode`), then higher priority, then FCFS."""
        return (self.params.yield_to_decode, -self.params.priority, self.arrival)

    @property
    def queue_s(self) -> float | None:
        """Seconds from entering the engine to the step that first scheduled its prompt."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def is_decoding(self) -> bool:
        """Its next step computes one generated token (not part of a prompt)."""
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to be computed or reported (before the first token)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, index: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < num_prompt else self.output_token_ids[index - num_prompt]

    def block_tokens(self, block_index: int, block_size: int) -> list[int]:
        start = block_index * block_size
        return [self.token_at(i) for i in range(start, min(start + block_size, self.num_tokens))]

    def block_hash(self, block_index: int, block_size: int) -> int:
        """The chained hash of full block `block_index` (cached: tokens never change once there)."""
        assert (block_index + 1) * block_size <= self.num_tokens, "only full blocks have a hash"
        while len(self._block_hashes) <= block_index:
            i = len(self._block_hashes)
            parent = self._block_hashes[-1] if self._block_hashes else ROOT_HASH
            self._block_hashes.append(hash_block(parent, self.block_tokens(i, block_size)))
        return self._block_hashes[block_index]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model's raw logits, and the `top` most likely
    tokens at that position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one `step()` reports about one request it advanced or ended."""

    request_id: str
    new_token_ids: list[int]  # tokens produced since the last report
    token_ids: list[int]  # all output tokens so far (includes the EOS / stop token)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str = ""  # new text since the last report (empty unless the engine detokenizes)
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With `SamplingParams.logprobs`: one entry per token of `new_token_ids`.
    logprobs: list[TokenLogprob] | None = None
    # With `SamplingParams.prompt_logprobs`, on the first output only: one entry per prompt
    # token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's `n` (or `best_of`) sequences this is
    # On the first output of a sequence whose prompt ran here: `Sequence.queue_s`.
    queue_s: float | None = None
