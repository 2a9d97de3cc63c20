"""Engine logprobs (`TokenLogprob`) in OpenAI's two response shapes.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, parallel lists with
one entry per token, `top_logprobs` a `{token text: logprob}` dict; an echoed prompt's
first token has no logprob (`null` in both lists). Chat: `{content: [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}`. A token's text is the tokenizer's
decoding of that one id; `bytes` are the token's own bytes, so a character split over
several tokens can be put back together by the client.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from workers.engine.sequence import TokenLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE characters -> the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token id's text and bytes, cached (a router sees the same ids over and over)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if match := _BYTE_PIECE.fullmatch(piece):
                return [int(match.group(1), 16)]
            alphabet = _byte_level_alphabet()
            if piece and all(ch in alphabet for ch in piece) and piece not in self.tokenizer.all_special_tokens:
                return [alphabet[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(texts: TokenTexts, token_ids: list[int], entries: list[TokenLogprob | None],
                        text_offset: int = 0, with_ids: bool = False) -> dict[str, Any]:
    """The completions shape for `token_ids` (an entry of None: no logprob, as for an
    echoed prompt's first token); offsets count from `text_offset`. `with_ids` (a request
    with `return_token_ids`) adds `top_logprob_ids`: each token's candidates as `[id,
    logprob]` pairs, which keeps candidates whose texts are equal apart."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if with_ids:
        out["top_logprob_ids"] = [None if e is None else [[i, lp] for i, lp in e.top] for e in entries]
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = texts.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else _top_by_text(texts, entry.top))
    return out


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob | None]) -> dict[str, Any]:
    return {"content": [{**_chat_token(texts, e.token_id, e.logprob),
                         "top_logprobs": [_chat_token(texts, i, lp) for i, lp in e.top]}
                        for e in entries if e is not None]}


def _chat_token(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}


def _top_by_text(texts, top) -> dict[str, float]:
    """`{token text: logprob}`, most likely first. Tokens whose texts are equal (bytes of a
    character cut in two all read as U+FFFD) share one key, which keeps the most likely."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(texts.text(token_id), logprob)
    return out
