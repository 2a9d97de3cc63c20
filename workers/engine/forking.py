"""A request of n > 1 sequences (n / best_of) forks from one prefill: when its first
token is sampled, the first tokens of its sequences 1.. are sampled from the same logits
(seeds seed + i), and it forks into them here (shared prompt blocks, copy-on-write of the
partial last one), or they travel with its KV to the engine that decodes it.

`LLMEngine` (llm_engine.py) composes this: the attributes below are its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from workers.engine.best_of import BestOf, add_scores
from workers.engine.best_of import holds as holds_best_of
from workers.engine.block_manager import BlockManager
from workers.engine.kv_types import FirstToken, KVLayout
from workers.engine.logprobs import token_logprobs
from workers.engine.model_runner import ModelRunner
from workers.engine.sampler import Sampler, SamplerOutput, SamplingRow
from workers.engine.scheduler import ScheduledSeq, Scheduler
from workers.engine.sequence import RequestOutput, Sequence, TokenLogprob


class Forking:
    """The n-sequence half of `LLMEngine`."""

    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    best_of: BestOf
    requests: dict[str, Sequence]
    layout: KVLayout
    _new_sequence: Callable[..., Sequence]  # (request_id, prompt, params, seed, index=0)
    _sampling_row: Callable[[Sequence, torch.Tensor | None], SamplingRow]
    _append_token: Callable[[Sequence, int, TokenLogprob | None], RequestOutput]

    def _fork(self, sampling: list[ScheduledSeq], logits: torch.Tensor, sampled: SamplerOutput,
              allowed: list[torch.Tensor | None]) -> list[RequestOutput]:
        """Requests with `num_sequences > 1` whose first token is sampled this step: the
        first tokens of their sequences 1.. are sampled from the same logits (seeds
        seed + i), and the request forks into them here or, when its KV goes to another
        engine, they go with it (`KVSink.on_complete`) and that engine forks it (`commit_kv`)."""
        outputs = []
        for row, s in enumerate(sampling):
            parent = s.seq
            if parent.params.num_sequences == 1 or parent.index or parent.output_token_ids:
                continue
            siblings = self._sample_siblings(parent, logits[row], allowed[row])
            if parent.kv_sink is not None:
                first, siblings = _scored(parent, logits[row], sampled.token_ids[row], sampled.logprobs[row], siblings)
                parent.kv_sink.on_complete(sampled.token_ids[row], first, siblings)
                parent.kv_sink = None
                continue
            children = self._fork_into(parent, siblings)
            outputs += [self._append_token(c, f.token_id, f.logprob) for c, f in zip(children, siblings, strict=True)]
            add_scores(children, logits[row].expand(len(children), -1))
        return outputs

    def _sample_siblings(self, parent: Sequence, logits: torch.Tensor,
                         allowed: torch.Tensor | None) -> tuple[FirstToken, ...]:
        """First tokens of `parent`'s sequences 1.. from its first token's logits `[vocab]`:
        `parent`'s sampling row (penalties, and `allowed`, the grammar mask its own token was
        sampled under) with seed `parent.seed + i`."""
        row = self._sampling_row(parent, allowed)
        rows = [dataclasses.replace(row, seed=parent.seed + i) for i in range(1, parent.params.num_sequences)]
        sampled = self.sampler.sample(logits.expand(len(rows), -1), rows)
        return tuple(FirstToken(t, lp) for t, lp in zip(sampled.token_ids, sampled.logprobs, strict=True))

    def _fork_into(self, parent: Sequence, siblings: Seq[FirstToken]) -> list[Sequence]:
        """Sequences 1.. of `parent`'s request (whose prompt is computed): each shares the
        prompt's full blocks and gets its own copy of the partial last one (copy-on-write
        where they diverge), then decodes on its own from its first token in `siblings`."""
        children = [self._new_sequence(parent.request_id, parent.prompt_token_ids, parent.params,
                                       parent.seed + i, index=i)
                    for i in range(1, len(siblings) + 1)]
        copies = [self.block_manager.fork(parent, child) for child in children]
        if any(b is not None for b in copies):
            diverging = parent.block_ids[parent.num_computed_tokens // self.layout.block_size]
            self.runner.kv_cache.copy_block(diverging, [b for b in copies if b is not None])
        for child in children:
            child.arrival, child.num_cached_tokens = parent.arrival, parent.num_cached_tokens
            child.prompt_logprobs = parent.prompt_logprobs
            self.requests[child.seq_id] = child
            self.best_of.track(child)
            self.scheduler.add(child)
        return children


def _scored(parent: Sequence, logits: torch.Tensor, token_id: int, logprob: TokenLogprob | None,
            siblings: tuple[FirstToken, ...]) -> tuple[TokenLogprob | None, tuple[FirstToken, ...]]:
    """The first tokens a `best_of > n` request hands to another engine carry their raw
    logprobs even when it asked for none: that engine ranks its sequences by them.
    (`logits`: the row the first tokens were sampled from.)"""
    if not holds_best_of(parent) or logprob is not None:
        return logprob, siblings
    ids = [token_id, *(f.token_id for f in siblings)]
    scored = token_logprobs(logits.expand(len(ids), -1), ids, [0] * len(ids))
    return scored[0], tuple(FirstToken(f.token_id, lp) for f, lp in zip(siblings, scored[1:], strict=True))
