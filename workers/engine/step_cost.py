"""What a step costs, learned from the engine's own step records.

Running estimates: the time of a step that only decodes, the time per prompt token of a
step that prefills, and what a prompt token adds to a step that decodes (small chunks
beside streams cost more per token than big ones: per-step work, attention over a long
context). The decode step over the marginal token cost sizes a background prefill's
chunk in a decoding step (`Scheduler.yield_tokens`): that many prompt tokens cost about
`YIELD_STEP_FRACTION` of a decode step, so the streams beside a background prefill keep
about 2/3 of their speed (a stream's TPOT SLO is usually a few times its unloaded TPOT,
which a loaded replica already eats into), and the prefill advances at about 1/3 of its
full speed while they decode, at full speed when they are done.
(The router's predictions use the fuller linear model of `cost_model`.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router reads `StepRecord` and never loads torch
    import torch

YIELD_STEP_FRACTION = 0.5  # a background chunk's cost, in decode steps
MIN_PREFILL_TOKENS = 64  # shorter chunks are dominated by per-step overhead, not tokens
EMA_WEIGHT = 0.2  # of the newest observation


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for the `auto` policy and the `plan` simulator to learn from."""

    start_time: float  # time.time() at step start
    step_time_s: float
    num_prefill_tokens: int  # prompt tokens computed this step
    num_decode_seqs: int  # sequences that produced a decode token this step
    num_context_tokens: int  # sum of context lengths attended over
    num_running: int
    num_waiting: int
    num_prefill_seqs: int = 0  # sequences that computed prompt tokens this step
    # sum over prefill chunks of chunk tokens x tokens the chunk attends to (its end)
    prefill_attention_work: int = 0
    # the mean number of other engines on this node computing during the step
    # (`node_activity.py`; 0 without a board)
    node_busy: float = 0.0
    # of step_time_s, the engine thread's time on a CPU and runnable but waiting for one
    # (`thread_clock.py`); the rest it was blocked (another thread held the interpreter)
    cpu_time_s: float = 0.0
    run_wait_s: float = 0.0
    # of num_decode_seqs, those whose token this step was their last: the time until the
    # next step is no gap of theirs (it may be an idle engine waiting for work)
    num_finished_streams: int = 0

    @property
    def ended_at(self) -> float:
        """When the step ended, which is when the engine recorded it."""
        return self.start_time + self.step_time_s


@dataclass(frozen=True)
class StepPhases:
    """Where one step's time went, from perf_counter stamps the step takes anyway (a
    record apart from `StepRecord`, which travels in heartbeats as flat numbers).

    `run_s` is the model runner's whole call: the step's attention metadata and input
    tensors, then the model's forward (`forward_s`, None when the forward ran without
    passing through the module's hooks). On a GPU the forward is launched, not finished,
    when `run_s` ends: sampling's first host read waits for it.
    """

    schedule_s: float
    run_s: float
    forward_s: float | None
    sample_s: float  # prompt logprobs, grammar masks, the sampler
    output_s: float  # token bookkeeping, forks, finish checks, text

    @property
    def metadata_s(self) -> float | None:
        return None if self.forward_s is None else max(0.0, self.run_s - self.forward_s)

    @property
    def step_s(self) -> float:
        return self.schedule_s + self.run_s + self.sample_s + self.output_s


class ForwardTimer:
    """The wall time of a module's forward, by hooks that stamp its start and end."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._start = self._end = 0.0
        module.register_forward_pre_hook(self._stamp_start)
        module.register_forward_hook(self._stamp_end)

    def _stamp_start(self, *_) -> None:
        self._start = time.perf_counter()

    def _stamp_end(self, *_) -> None:
        self._end = time.perf_counter()

    def take(self) -> float | None:
        """The last forward's seconds since the previous `take`; None if none ran since."""
        elapsed = self._end - self._start if self._end > self._start else None
        self._start = self._end = 0.0
        return elapsed


@dataclass
class StepCostModel:
    decode_step_s: float | None = None  # a step with decode tokens only
    prefill_token_s: float | None = None  # per prompt token, in steps that prefill
    # what prompt tokens added to decoding steps: time and tokens, each averaged, so a
    # 1-token chunk (a prompt's last token) weighs as one token, not as a whole chunk
    _added_s: float | None = None
    _added_tokens: float | None = None

    def observe(self, record: StepRecord) -> None:
        prefill, decode = record.num_prefill_tokens, record.num_decode_seqs
        if prefill == 0 and decode > 0:
            self.decode_step_s = _ema(self.decode_step_s, record.step_time_s)
        elif prefill > 0 and decode > 0 and self.decode_step_s:
            self._added_s = _ema(self._added_s, max(0.0, record.step_time_s - self.decode_step_s))
            self._added_tokens = _ema(self._added_tokens, float(prefill))
        if prefill >= MIN_PREFILL_TOKENS:
            self.prefill_token_s = _ema(self.prefill_token_s, record.step_time_s / prefill)

    @property
    def marginal_token_s(self) -> float | None:
        """Per prompt token added to a step that decodes."""
        if self._added_s is None or not self._added_tokens:
            return None
        return self._added_s / self._added_tokens

    def yield_tokens(self, default: int, limit: int) -> int:
        """Prompt tokens that add about `YIELD_STEP_FRACTION` of a decode step to a step
        that decodes, in [1, limit]; `default` until the costs are known."""
        token_s = self.marginal_token_s or self.prefill_token_s
        if not self.decode_step_s or not token_s:
            return min(default, limit)
        return max(1, min(limit, int(YIELD_STEP_FRACTION * self.decode_step_s / token_s)))


def _ema(current: float | None, value: float) -> float:
    return value if current is None else (1.0 - EMA_WEIGHT) * current + EMA_WEIGHT * value
