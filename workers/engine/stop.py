"""When a request is finished, and how much of its text may be shown so far.

Checked after every generated token, in vLLM's order: nothing stops a request before
`min_tokens`; then EOS (unless `ignore_eos`), `stop_token_ids`, stop strings, and
`max_tokens`. The token that ended a request stays in its output ids; a stop string is
cut from the text, with everything after it (as OpenAI does).

Streams must never show part of a stop string, so text that could be the start of one
is held back until the next tokens tell whether it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str | None  # "stop", "length" or None (not finished)
    stop_reason: int | str | None  # the stop token id or stop string that matched
    text: str  # new text the caller may emit now


class StopChecker:
    """One per request. Feed it every generated token with the text the incremental
    detokenizer returned for it: `append(token_id, new_text) -> StopDecision`.

    When a request finishes for any reason but a stop string, the decision's text
    includes all that was held back; pass `detokenizer.flush()` through `release` to get
    the last bytes the detokenizer held.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_tokens = 0
        self.text = ""  # all generated text so far (cut at the stop string once matched)
        self.num_emitted_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def append(self, token_id: int, new_text: str = "") -> StopDecision:
        assert self.finish_reason is None, "append after the request finished"
        self.num_tokens += 1
        self.text += new_text
        self.finish_reason, self.stop_reason = self._check(token_id, len(new_text))
        return StopDecision(self.finish_reason, self.stop_reason, self._take_emittable())

    def release(self, tail_text: str) -> str:
        """Text the detokenizer still held when the request finished, unless a stop string
        ended it (then nothing after the stop string is shown)."""
        assert self.finish_reason is not None
        if isinstance(self.stop_reason, str):
            return ""
        self.text += tail_text
        return self._take_emittable()

    def _check(self, token_id: int, new_text_len: int) -> tuple[str | None, int | str | None]:
        if self.num_tokens < self.params.min_tokens:
            return None, None
        if token_id in self.eos_token_ids and not self.params.ignore_eos:
            return "stop", None
        if token_id in self.params.stop_token_ids:
            return "stop", token_id
        stop_string = self._match_stop_string(new_text_len)
        if stop_string is not None:
            return "stop", stop_string
        if self.num_tokens >= self.params.max_tokens:
            return "length", None
        return None, None

    def _match_stop_string(self, new_text_len: int) -> str | None:
        """The stop string a character stream would complete first, among those ending in
        the new text; cuts the text before it. Matches that ended earlier (under
        `min_tokens`) don't count."""
        if not new_text_len or not self.params.stop:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.params.stop:
            begin = max(0, len(self.text) - new_text_len - len(stop) + 1)
            at = self.text.find(stop, begin)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is None:
            return None
        self.text = self.text[:best[1]]
        return best[2]

    def _take_emittable(self) -> str:
        end = len(self.text) if self.finish_reason else len(self.text) - self._held_back_len()
        assert end >= self.num_emitted_chars, "a stop string began in text already emitted"
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out

    def _held_back_len(self) -> int:
        """Length of the longest end of the text that a stop string begins with."""
        longest = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
