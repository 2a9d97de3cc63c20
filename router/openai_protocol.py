"""Request bodies of `/v1/completions` and `/v1/chat/completions` (INTERFACES.md).

Strict types: a string where a number belongs is a 400, not a silent conversion. Every
field declared here is honoured; router/openai_fields.py lists the OpenAI fields that are
accepted without effect and those refused with a 400. Other unknown fields are not part
of OpenAI's API and are ignored (`extra="ignore"`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.errors import FieldError
from workers.engine.sampling_params import MAX_LOGPROBS, GuidedDecoding, SamplingParams

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n and best_of: each is a sequence in the engine
MAX_LOGIT_BIAS = 1024
MAX_PROMPTS = 64  # prompts in one completions request
NonNegInt = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Prompt = str | list[int]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(default="response", max_length=64)
    description: str | None = None  # guidance for the model, not a constraint
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is always held to the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("json_schema", "is required when type is json_schema")  # pydantic prefixes the path
        return self


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints, including the pdcluster extensions."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)  # None: the config's default
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: disabled
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    # Extensions.
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[NonNegInt] | None = None
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for token, bias in value.items():
            if not token.isdigit():
                raise ValueError(f"key {token!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {token} is outside [-100, 100]")
        return value

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("must list at least one choice")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingRequest:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise FieldError(given[-1], f"at most one of {', '.join(given)} may be given")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def best_of_value(self) -> int | None:
        return None

    @property
    def guided_param(self) -> str:
        """The field that asked for an output constraint (for a 400 about it)."""
        names = ("guided_json", "guided_regex", "guided_choice")
        return next((name for name in names if getattr(self, name) is not None), "response_format")

    def guided(self) -> GuidedDecoding | None:
        """The output constraint asked for, if any (validated against the grammar by the router)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return GuidedDecoding("json_object")
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_ if fmt.json_schema else None
            return GuidedDecoding("json_schema", json.dumps(schema)) if schema else GuidedDecoding("json_object")
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return GuidedDecoding("json_schema", spec)
        if self.guided_regex is not None:
            return GuidedDecoding("regex", self.guided_regex)
        if self.guided_choice is not None:
            return GuidedDecoding("choice", json.dumps(self.guided_choice))
        return None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine."""
        return None, None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine params, `max_tokens` already resolved by the router (at least 1)."""
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), seed=self.seed, stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias or {}),
            n=self.n, best_of=self.best_of_value, guided=self.guided(),
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[NonNegInt]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, only the prompt
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt")
    @classmethod
    def _prompts_given(cls, value: Any) -> Any:
        prompts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompt must not be empty")
        if any(isinstance(t, int) and t < 0 for p in prompts if isinstance(p, list) for t in p):
            raise ValueError("token ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _choices_and_echo(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", "must be >= n")
        if self.stream and (self.best_of or self.n) > self.n:
            raise FieldError("best_of", "best_of > n cannot be streamed")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "must be at least 1 (0 only with echo)")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """One prompt per choice group: a string or a token-id list."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]

    @property
    def best_of_value(self) -> int | None:
        return self.best_of

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # history of an earlier tool call
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("content", "is required (only an assistant message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def _merge_fields(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return self

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template() for m in self.messages]
