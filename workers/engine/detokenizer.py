"""Incremental detokenization that never emits a broken character mid-stream.

A character can span several tokens (the byte-level tokenizer of `make-model` emits one
token per UTF-8 byte; BPE and SentencePiece byte-fallback tokens split characters too),
and SentencePiece drops a word's leading space when the word is decoded alone. So text is
never decoded token by token: a short window of ids, starting a little before the new
ones, is decoded, and only the text past the window's already-emitted prefix is emitted,
once it no longer ends in U+FFFD (an incomplete character decodes as U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as context for the first generated ones, so a first word's leading
# space (and a character begun by the prompt's tail) decodes as it would in running text.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """`push(token_id) -> new text`, `flush() -> the rest` once the sequence ends.

    `token_ids[prefix_offset:read_offset]` is context whose text (`prefix_text`) is out
    already; `token_ids[read_offset:]` are tokens whose text is not out yet.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = backend_decode(tokenizer, skip_special_tokens)
        self.token_ids = list(prompt_token_ids or ())[-PROMPT_CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        # A prompt may end inside a character (BPE merges cut characters); the generated
        # tokens that complete it emit the whole character.
        self.prefix_text = self._decode(self.token_ids).rstrip(REPLACEMENT_CHAR)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (maybe "")."""
        self.token_ids.append(token_id)
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(self.prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text still held back (with U+FFFD for bytes that never formed a character)."""
        return self._advance(self._decode(self.token_ids[self.prefix_offset:]))

    def _advance(self, text: str) -> str:
        """Emit what `text` adds to the prefix; the tokens just read become the prefix."""
        new_text = text[len(self.prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.prefix_text = self._decode(self.token_ids[self.prefix_offset:])
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""


def backend_decode(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`tokenizer.decode`, straight to its Rust backend where transformers' wrapper adds
    nothing to the text (a fast tokenizer that overrides no decoding and cleans up no
    spaces): on a short window the wrapper's argument handling costs several times the
    decode itself, paid per generated token of every sequence."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode, always right
        TokenizersBackend = None  # noqa: N806
    cls = type(tokenizer)
    plain = (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
             and cls.decode is TokenizersBackend.decode and cls._decode is TokenizersBackend._decode
             and not tokenizer.clean_up_tokenization_spaces)
    if plain:
        backend = tokenizer.backend_tokenizer
        return lambda token_ids: backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
