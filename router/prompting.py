"""Prompts to token ids, in the router (one tokenizer per router replica).

Completions take a string or a token-id list; chat goes through the model's own chat
template with the generation prompt appended. Every problem is a 400 naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from router.errors import bad_request
from router.openai_protocol import ChatCompletionRequest, CompletionRequest


class PromptBuilder:
    def __init__(self, model_dir: str | Path, max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = max_model_len or _max_positions(Path(model_dir))

    def completion_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            return self._encode(req.prompt, "prompt")
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary "
                              f"(size {self.vocab_size})", param="prompt")
        return list(req.prompt)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                req.template_messages(), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may reject a role order; that is the client's input
            raise bad_request(f"messages: {e}", param="messages") from None
        return self._encode(text, "messages")

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{param}: text is not valid Unicode", param=param) from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        return ids


def _max_positions(model_dir: Path) -> int:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 2048
    return int(config.get("max_position_embeddings") or 2048)
