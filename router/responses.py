"""OpenAI response bodies and stream chunks for both endpoints.

A request may run several worker calls (one per completions prompt), each with one or
more sequences (`n`); choice `index` is `prompt index * n + sequence index`. A
`ChoiceState` gathers one choice; `ResponseShape.piece` turns one worker chunk into that
choice's new text, token ids and logprobs, adding an echoed prompt before its first piece.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from router.sse import usage
from workers.protocol import GenerateChunk


@dataclass
class ChoiceState:
    index: int
    prompt_ids: list[int]
    prompt_text: str
    text: str = ""  # what the client got so far (echo included)
    token_ids: list[int] = field(default_factory=list)  # generated tokens the client got
    logprobs: dict[str, Any] | None = None  # merged, for the non-streamed body
    finish_reason: str | None = None
    started: bool = False


@dataclass
class Piece:
    text: str
    token_ids: list[int]
    logprobs: dict[str, Any] | None


@dataclass
class ResponseShape:
    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    texts: TokenTexts
    return_token_ids: bool = False
    n: int = 1
    logprobs: bool = False  # render logprobs
    echo: bool = False
    drop_generated: bool = False  # max_tokens 0 with echo: the engine's one token is not answered
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def piece(self, state: ChoiceState, chunk: GenerateChunk) -> Piece:
        """This chunk's part of the choice (and the state advanced past it)."""
        ids, text = list(chunk.token_ids), chunk.text
        entries = list(chunk.logprobs) if chunk.logprobs is not None else [None] * len(ids)
        if self.drop_generated:
            ids, text, entries = [], "", []
        shown_ids, shown_entries = ids, entries
        if self.kind == "completion" and self.echo and not state.started:
            prompt_entries = chunk.prompt_logprobs or [None] * len(state.prompt_ids)
            text = state.prompt_text + text
            shown_ids, shown_entries = state.prompt_ids + ids, list(prompt_entries) + entries
        state.started = True
        logprobs = None
        if self.logprobs and self.kind == "completion":
            logprobs = completion_logprobs(self.texts, shown_ids, shown_entries, len(state.text),
                                           with_ids=self.return_token_ids)
        elif self.logprobs:
            logprobs = chat_logprobs(self.texts, entries)
        state.text += text
        state.token_ids.extend(ids)
        state.logprobs = _merge(state.logprobs, logprobs)
        if chunk.finished or chunk.finish_reason:
            state.finish_reason = chunk.finish_reason
        return Piece(text, ids, logprobs)

    def role_chunk(self, index: int, prompt_ids: list[int] | None) -> dict[str, Any]:
        """Chat streams open with the assistant role (no content, so not a TTFT event)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._with_prompt_ids({**self.base(), "choices": [choice]}, prompt_ids)

    def chunk(self, index: int, piece: Piece, finish_reason: str | None,
              prompt_ids: list[int] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": {"content": piece.text} if piece.text else {},
                                      "logprobs": piece.logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": piece.text, "logprobs": piece.logprobs,
                      "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(piece.token_ids)
        return self._with_prompt_ids({**self.base(), "choices": [choice]}, prompt_ids)

    def final(self, states: list[ChoiceState], num_prompt_tokens: int,
              prompt_ids: list[int] | None) -> dict[str, Any]:
        choices = [self._final_choice(s) for s in sorted(states, key=lambda s: s.index)]
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = {**self.base(), "object": obj, "choices": choices,
                "usage": usage(num_prompt_tokens, sum(len(s.token_ids) for s in states))}
        return self._with_prompt_ids(body, prompt_ids)

    def _final_choice(self, state: ChoiceState) -> dict[str, Any]:
        logprobs = state.logprobs if self.logprobs else None
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": state.index, "message": {"role": "assistant", "content": state.text},
                                      "logprobs": logprobs, "finish_reason": state.finish_reason}
        else:
            choice = {"index": state.index, "text": state.text, "logprobs": logprobs,
                      "finish_reason": state.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(state.token_ids)
        return choice

    def _with_prompt_ids(self, body: dict[str, Any], prompt_ids: list[int] | None) -> dict[str, Any]:
        if self.return_token_ids and prompt_ids is not None:
            body["prompt_token_ids"] = list(prompt_ids)
        return body


def _merge(total: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    """Logprob dicts of consecutive pieces as one (their lists concatenated)."""
    if part is None:
        return total
    if total is None:
        return {k: list(v) for k, v in part.items()}
    for key, values in part.items():
        total[key].extend(values)
    return total
