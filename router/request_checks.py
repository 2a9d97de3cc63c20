"""Checks of a parsed request that need the server's limits or the tokenizer.

`max_tokens` is never quietly capped: above `limits.max_tokens_limit`, or beyond what the
context leaves after the prompt, it is a 400 naming the limit, as OpenAI and vLLM answer.
Only an absent `max_tokens` takes the configured default, capped to what the context leaves.
"""

from __future__ import annotations

from router.errors import (
    bad_request,
    context_length_exceeded,
    max_tokens_over_context,
    max_tokens_over_limit,
)
from router.prompting import PromptBuilder
from workers.engine.grammar_text import validate_guided


def engine_max_tokens(req, prompt_len: int, limits, max_model_len: int) -> int:
    """What the engine generates for one prompt (`limits`: the config's LimitsConfig); a `max_tokens` of 0 (echo only) runs 1,
    whose token the answer drops."""
    if prompt_len >= max_model_len:
        raise context_length_exceeded(prompt_len, max_model_len)
    room = max_model_len - prompt_len
    if req.max_tokens is None:
        return max(1, min(limits.default_max_tokens, limits.max_tokens_limit, room))
    if req.max_tokens > limits.max_tokens_limit:
        raise max_tokens_over_limit(req.max_tokens_param, req.max_tokens, limits.max_tokens_limit)
    if req.max_tokens > room:
        raise max_tokens_over_context(req.max_tokens_param, req.max_tokens, prompt_len, max_model_len)
    if req.min_tokens > req.max_tokens:
        raise bad_request("min_tokens: must be <= max_tokens", param="min_tokens")
    return max(1, req.max_tokens)


def check_vocabulary_fields(req, prompts: PromptBuilder) -> None:
    """Logit-bias ids inside the vocabulary; an output constraint the grammar can express."""
    bad = [t for t in (req.logit_bias or {}) if int(t) >= prompts.vocab_size]
    if bad:
        raise bad_request(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                          f"(size {prompts.vocab_size})", param="logit_bias")
    guided = req.guided()
    if guided is not None:
        _validate_guided(guided, prompts.tokenizer, req.guided_param)


def _validate_guided(guided, tokenizer, param: str) -> None:
    try:
        validate_guided(guided, tokenizer)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
