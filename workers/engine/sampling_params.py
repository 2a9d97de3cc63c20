"""Per-request generation settings (the offline API of INTERFACES.md)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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


def _as_tuple(value) -> tuple:
    if isinstance(value, str):
        return (value,)
    return tuple(value or ())


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
