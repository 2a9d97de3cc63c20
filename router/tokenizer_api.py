"""`POST /tokenize` and `POST /detokenize`, with vLLM's bodies.

tokenize: `{model, prompt}` or `{model, messages, add_generation_prompt}` ->
`{tokens, count, max_model_len}`; detokenize: `{model, tokens}` -> `{prompt}`. The ids are
exactly those a completions or chat request with the same input would be served with.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.errors import bad_request, from_validation_error
from router.openai_protocol import ChatMessage, NonNegInt
from router.prompting import PromptBuilder


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[NonNegInt]


def parse(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def tokenize(prompts: PromptBuilder, req: TokenizeRequest) -> dict[str, Any]:
    if req.messages is not None:
        ids = prompts.template_ids([m.template() for m in req.messages], req.add_generation_prompt)
    else:
        ids = prompts.prompt_ids(req.prompt or "") if req.prompt else []
    return {"tokens": ids, "count": len(ids), "max_model_len": prompts.max_model_len}


def detokenize(prompts: PromptBuilder, req: DetokenizeRequest) -> dict[str, Any]:
    prompts.check_token_ids(req.tokens, "tokens")
    return {"prompt": prompts.tokenizer.decode(req.tokens)}
