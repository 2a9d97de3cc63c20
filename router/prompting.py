"""Prompts to token ids, in the router (one tokenizer per router replica).

A completions prompt is a string or a token-id list; chat goes through the model's own chat
template with the generation prompt appended. Every problem is a 400 naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from router.errors import bad_request
from router.openai_protocol import ChatCompletionRequest, Prompt


class PromptBuilder:
    def __init__(self, model_dir: str | Path, max_model_len: int | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = max_model_len or _max_positions(Path(model_dir))

    def prompt_ids(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, param)
        self.check_token_ids(prompt, param)
        return list(prompt)

    def prompt_text(self, prompt: Prompt) -> str:
        """The prompt as text, as an echo returns it."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        return self.template_ids(req.template_messages(), add_generation_prompt=True)

    def template_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template may reject a role order; that is the client's input
            raise bad_request(f"messages: {e}", param="messages") from None
        return self._encode(text, "messages")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise bad_request(f"{param}: token id {bad[0]} is outside the vocabulary "
                              f"(size {self.vocab_size})", param=param)

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
