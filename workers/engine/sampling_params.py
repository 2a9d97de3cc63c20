"""Per-request generation settings (the offline API of INTERFACES.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
GuidedKind = Literal["json_object", "json_schema", "regex", "choice"]


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the output's text. `spec` is a JSON schema (as JSON text) for
    `json_schema`, a regular expression for `regex`, a JSON list of strings for `choice`,
    and empty for `json_object` (any JSON object)."""

    kind: GuidedKind
    spec: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in ("json_object", "json_schema", "regex", "choice"), "guided.kind",
               "must be json_object, json_schema, regex or choice")
        if self.kind == "choice":
            choices = json.loads(self.spec) if self.spec else None
            _check(isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices),
                   "guided.spec", "must be a JSON list of strings for choice")
        elif self.kind != "json_object":
            _check(bool(self.spec), "guided.spec", f"is required for {self.kind}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0  # higher is admitted first and preempted last
    # A background prefill (a prompt the router spilled onto a busy decode replica): it
    # sorts after every other request and, in a step that decodes, computes only the
    # scheduler's `yield_tokens`, so the streams beside it keep their pace.
    yield_to_decode: bool = False
    # A background prefill's chunk in a step that decodes, in prompt tokens, instead of the
    # engine-wide `yield_tokens`: the router sizes it to keep the streams inside their SLO.
    prefill_chunk_tokens: int | None = None
    # Log-probabilities, from the model's raw logits (before bias, penalties, a grammar mask
    # and temperature): None = none; K = the chosen token's plus its K most likely
    # alternatives, for each generated token (`logprobs`) or each prompt token (`prompt_logprobs`).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's penalties over generated tokens, HF/vLLM's repetition penalty over prompt and
    # generated tokens, and additive biases (token id, bias) on the logits.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Several completions of one prompt, sharing its KV: `best_of` are generated (seeds
    # seed, seed + 1, ...) and the `n` with the highest cumulative logprob are returned.
    n: int = 1
    best_of: int | None = None
    guided: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        if isinstance(self.guided, dict):
            object.__setattr__(self, "guided", GuidedDecoding(**self.guided))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine runs for this request: `best_of`, else `n`."""
        return self.best_of or self.n

    def validate(self) -> None:
        """Raise ValueError naming the field, so callers can answer with a clear 400."""
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"must be 0..{MAX_LOGPROBS}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
               "logit_bias", "must map token ids >= 0 to biases in [-100, 100]")
        _check(self.prefill_chunk_tokens is None
               or (type(self.prefill_chunk_tokens) is int and self.prefill_chunk_tokens >= 1),
               "prefill_chunk_tokens", "must be an integer >= 1 when set")
        _check(self.n >= 1, "n", "must be at least 1")
        _check(self.best_of is None or self.best_of >= self.n, "best_of", "must be >= n")


def _as_tuple(value) -> tuple:
    if isinstance(value, str):
        return (value,)
    return tuple(value or ())


def _as_bias(value) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, dict) else (value or ())
    return tuple(sorted((int(t), float(b)) for t, b in items))


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
