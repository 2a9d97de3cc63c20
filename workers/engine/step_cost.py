"""What a step costs, learned from the engine's own step records.

Two running estimates: the time of a step that only decodes, and the time per prompt
token of a step that prefills. Their ratio sizes a background prefill's chunk in a
decoding step (`Scheduler.yield_tokens`): that many prompt tokens cost about one decode
step, so the streams beside a background prefill run at no less than about half speed.
(The `auto` policy's future TTFT/TPOT predictions start from the same two numbers.)
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.kv_types import StepRecord

MIN_PREFILL_TOKENS = 64  # shorter chunks are dominated by per-step overhead, not tokens
EMA_WEIGHT = 0.2  # of the newest observation


@dataclass
class StepCostModel:
    decode_step_s: float | None = None  # a step with decode tokens only
    prefill_token_s: float | None = None  # per prompt token, in steps that prefill

    def observe(self, record: StepRecord) -> None:
        if record.num_prefill_tokens == 0 and record.num_decode_seqs > 0:
            self.decode_step_s = _ema(self.decode_step_s, record.step_time_s)
        elif record.num_prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_token_s = _ema(self.prefill_token_s, record.step_time_s / record.num_prefill_tokens)

    def yield_tokens(self, default: int, limit: int) -> int:
        """Prompt tokens that cost about one decode step, in [1, limit]; `default` until
        both estimates exist."""
        if not self.decode_step_s or not self.prefill_token_s:
            return min(default, limit)
        return max(1, min(limit, int(self.decode_step_s / self.prefill_token_s)))


def _ema(current: float | None, value: float) -> float:
    return value if current is None else (1.0 - EMA_WEIGHT) * current + EMA_WEIGHT * value
