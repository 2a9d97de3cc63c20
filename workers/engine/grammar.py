"""Structured outputs: a `GuidedDecoding` compiled, through llguidance, into a per-request
matcher that says which tokens may come next.

    GrammarCompiler(tokenizer, vocab_size, eos_token_ids)       one per engine
    compiler.matcher(guided) -> GuidedMatcher                    one per sequence
    matcher.allowed() -> bool[vocab_size]       the next position's mask (kept until accept)
    matcher.accept(token_id)                    advance; ValueError if the grammar forbids it
    matcher.is_terminated()                     the grammar is complete: only EOS may follow
    matcher.rollback(num_tokens), matcher.fork()
    mask_disallowed(logits, rows)               the sampler's step: disallowed -> -inf

The grammar text, its JSON options and the check before admission are
`workers/engine/grammar_text.py`, which loads no torch.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from workers.engine.grammar_text import MAX_CACHED_GRAMMARS, grammar_text, ll_tokenizer
from workers.engine.sampling_params import GuidedDecoding

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from workers.engine.sampler import SamplingRow


class GrammarCompiler:
    """Per engine: compiles each (kind, spec) once into a template matcher (LRU-bounded) and
    hands every sequence a copy, which costs microseconds instead of a compile."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int],
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: masks are this long (padding disallowed)
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.max_cached = max_cached
        self._templates: OrderedDict[GuidedDecoding, llguidance.LLMatcher] = OrderedDict()

    @functools.cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        num_tokens = len(self.tokenizer)
        return ll_tokenizer(self.tokenizer, tuple(t for t in self.eos_token_ids if t < num_tokens))

    def matcher(self, guided: GuidedDecoding) -> GuidedMatcher:
        """A fresh matcher at the grammar's start; ValueError if `guided` does not compile."""
        return GuidedMatcher(self._template(guided).deep_copy(), self.vocab_size, self.eos_token_ids)

    def _template(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        template = self._templates.get(guided)
        if template is None:
            template = llguidance.LLMatcher(self._ll_tokenizer, grammar_text(guided), log_level=0)
            if template.is_error():
                raise ValueError(f"guided {guided.kind}: {template.get_error()}")
            self._templates[guided] = template
            if len(self._templates) > self.max_cached:
                self._templates.popitem(last=False)
        self._templates.move_to_end(guided)
        return template


class GuidedMatcher:
    """One sequence's position in its grammar. Advances only by `accept`, once per generated
    token (the engine's `_append_token`), so recomputing a preempted sequence never moves it."""

    def __init__(self, ll_matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: tuple[int, ...],
                 allowed: torch.Tensor | None = None) -> None:
        self._ll = ll_matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._allowed = allowed  # the next position's mask, computed at most once

    def allowed(self) -> torch.Tensor:
        """bool[vocab_size]: the tokens that keep the output inside the grammar. EOS ids are
        allowed exactly where the grammar may end; ids beyond the tokenizer never are."""
        if self._allowed is None:
            self._allowed = self._compute_mask()
        return self._allowed

    def _compute_mask(self) -> torch.Tensor:
        # numpy, not torch: a handful of tiny ops, where torch's per-op overhead would
        # cost several times llguidance's own work.
        bits = np.unpackbits(np.frombuffer(self._ll.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab_size, dtype=bool)
        num_known = min(len(bits), self.vocab_size)
        mask[:num_known] = bits[:num_known]
        mask[[t for t in self.eos_token_ids if t < self.vocab_size]] = self._ll.is_accepting()
        return torch.from_numpy(mask)

    def accept(self, token_id: int) -> None:
        """Advance over a generated token; ValueError if the grammar does not allow it."""
        if not self._ll.consume_token(token_id):
            raise ValueError(f"guided decoding: token {token_id} is outside the grammar ({self._ll.get_error()})")
        self._allowed = None

    def is_terminated(self) -> bool:
        return self._ll.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if not self._ll.rollback(num_tokens):
            raise ValueError(f"guided decoding: cannot roll back {num_tokens} tokens")
        self._allowed = None

    def fork(self) -> GuidedMatcher:
        """An independent matcher at the same position (a forked sequence's)."""
        return GuidedMatcher(self._ll.deep_copy(), self.vocab_size, self.eos_token_ids, self._allowed)


def mask_disallowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set every token a row's grammar forbids (`row.allowed`) to -inf; out of place, as the
    caller may still read its input. A row whose every allowed token another rule already
    masked (`min_tokens` against a grammar that can only end) samples among the grammar's."""
    guided = [i for i, row in enumerate(rows) if row.allowed is not None]
    if not guided:
        return logits
    index = torch.tensor(guided, device=logits.device)
    allowed = torch.stack([rows[i].allowed for i in guided]).to(logits.device, non_blocking=True)
    assert allowed.shape[1] == logits.shape[1], (allowed.shape, logits.shape)
    masked = logits[index].masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(dim=1, keepdim=True)
    masked = torch.where(dead & allowed, 0.0, masked)
    return logits.index_copy(0, index, masked)
