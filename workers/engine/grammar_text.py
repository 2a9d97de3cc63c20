"""A `GuidedDecoding` turned into llguidance's grammar, and checked against a tokenizer
before a request is admitted. No torch: the router validates with it, and the engine's
matchers (`workers/engine/grammar.py`) compile the same grammar text.

    validate_guided(guided, tokenizer)   raise ValueError naming what is wrong (cached,
                                         cheap on repeat)
    grammar_text(guided)                 llguidance's grammar for it (cached)
    ll_tokenizer(tokenizer, eos_ids)     llguidance's view of a Hugging Face tokenizer

JSON is compact (`,` and `:` without spaces): a model cannot wander off into whitespace,
and the text is what `json.dumps(..., separators=(",", ":"))` writes.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf

from workers.engine.sampling_params import GuidedDecoding

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

JSON_OPTIONS = {"whitespace_flexible": False}
MAX_CACHED_GRAMMARS = 256


def validate_guided(guided: GuidedDecoding, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise ValueError naming the problem when `guided` cannot be compiled (an invalid or
    unsupported schema, regex or choice list); the answer is cached per (tokenizer, guided)."""
    error = _validation_error(tokenizer, guided)
    if error:
        raise ValueError(error)


@functools.lru_cache(maxsize=1024)
def _validation_error(tokenizer: PreTrainedTokenizerBase, guided: GuidedDecoding) -> str:
    try:
        grammar = grammar_text(guided)
    except ValueError as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, ll_tokenizer(tokenizer, (tokenizer.eos_token_id,)))
    return f"guided {guided.kind}: {' '.join(messages[0].split())}" if is_error else ""


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def grammar_text(guided: GuidedDecoding) -> str:
    """llguidance's grammar for `guided`; ValueError for a spec that is not even well formed."""
    if guided.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if guided.kind == "json_schema":
        try:
            schema = json.loads(guided.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided json_schema: the schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError("guided json_schema: the schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if guided.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guided.spec)
    choices = json.loads(guided.spec)
    if any(not c for c in choices):
        raise ValueError("guided choice: a choice must not be empty")
    # Lark string literals take JSON's escapes, so any text is one quoted alternative.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (hundreds of ms for a large vocab)."""
    return llguidance.hf.from_tokenizer(tokenizer, eos_token=[t for t in eos_token_ids if t is not None])
