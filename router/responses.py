"""OpenAI response bodies and stream chunks for both endpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from router.sse import usage


@dataclass
class ResponseShape:
    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self, prompt_ids: list[int]) -> dict[str, Any]:
        """Chat streams open with the assistant role (no content, so not a TTFT event)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._with_prompt_ids({**self.base(), "choices": [choice]}, prompt_ids)

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              prompt_ids: list[int] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return self._with_prompt_ids({**self.base(), "choices": [choice]}, prompt_ids)

    def final(self, text: str, token_ids: list[int], finish_reason: str | None,
              prompt_ids: list[int]) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        body = {**self.base(), "object": obj, "choices": [choice],
                "usage": usage(len(prompt_ids), len(token_ids))}
        return self._with_prompt_ids(body, prompt_ids)

    def _with_prompt_ids(self, body: dict[str, Any], prompt_ids: list[int] | None) -> dict[str, Any]:
        if self.return_token_ids and prompt_ids is not None:
            body["prompt_token_ids"] = list(prompt_ids)
        return body
