"""How a replica's prompt queue drains, step by step, under its scheduler's rules.

A step's token budget (`chunk_tokens`, less one token per stream) goes to the streams'
decode tokens, then to the prompts in arrival order, except for one chunk kept every
step for the first background prefill (`Scheduler._background_reserve`). So a replica's
prompts drain in two lanes side by side:

- the background lane at its first prompt's chunk per step (a step without streams or
  foreground prompts gives it the whole budget); a later background prompt starts once
  the first is done or no foreground prompt is left to take the rest of the budget;
- the foreground lane, in arrival order, at whatever the background chunk leaves.

Pricing a queue as one lane of full chunks made a background prefill of 2,000 tokens
(72 steps of 28 tokens beside the streams) look like four steps of 512: its streams
predicted at 590 ms a token where they saw 40, and every route beside it looked as if it
broke their objective. The closed form below walks the lanes by phases (at most three),
not by steps, so pricing a candidate stays a few microseconds.

A step costs `per_step_s` (the fixed cost and the streams' decode) plus its prompt
tokens' cost; a partly drained prompt's attention work is counted in proportion to its
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.replica_load import ReplicaLoad
from workers.engine.cost_model import StepCoefficients, prefill_work
from workers.engine.scheduler import DEFAULT_YIELD_TOKENS

Phases = tuple[tuple[float, float], ...]  # busy steps in order, as (steps, mean step) runs


@dataclass(frozen=True, slots=True)
class Own:
    """The prompt being priced: its tokens, its attention work, and the lane it joins."""

    tokens: int
    work: int
    background_chunk: int | None = None  # None: the foreground lane


@dataclass(frozen=True, slots=True)
class Drain:
    # from now until the priced prompt's last chunk (no prompt: the foreground lane's last,
    # or the background's when there is no foreground)
    seconds: float
    steps: int  # the steps of `seconds`
    busy_steps: int  # steps until both lanes are empty, the priced prompt's included
    busy_s: float  # their time
    own_steps: int = 0  # steps that computed the priced prompt's chunks
    own_s: float = 0.0  # their time

    @property
    def step_s(self) -> float:
        """The mean step while prompt chunks run."""
        return self.busy_s / self.busy_steps if self.busy_steps else 0.0

    @property
    def own_step_s(self) -> float:
        return self.own_s / self.own_steps if self.own_steps else 0.0

    @property
    def after_steps(self) -> int:
        """Steps that still carry prompt chunks once the priced prompt is done."""
        return max(0, self.busy_steps - self.steps)

    @property
    def after_step_s(self) -> float:
        """Their mean time."""
        return (self.busy_s - self.seconds) / self.after_steps if self.after_steps else 0.0

    @property
    def phases(self) -> Phases:
        """The busy steps in order, as (steps, mean step) runs: those up to the priced
        prompt's last chunk (no prompt: the foreground lane's), then those the lanes
        still carry. A stream a few tokens from its end sees only the first: the
        foreground's full-budget chunks come first, a background prompt's small ones
        trail on after them."""
        steps, after = self.steps, self.busy_steps - self.steps  # `after_steps`, inlined: per candidate
        head = (float(steps), self.seconds / steps) if steps else (0.0, 0.0)
        if after <= 0:
            return head, (0.0, 0.0)
        return head, (float(after), (self.busy_s - self.seconds) / after)


def token_cost(c: StepCoefficients, tokens: float, work: float) -> float:
    return c.prefill_token_s * tokens + c.prefill_attention_s * work


def per_step_s(r: ReplicaLoad) -> float:
    """A step's cost before its prompt tokens: the fixed cost and the streams' decode."""
    c = r.coefficients
    return c.fixed_s + c.decode_seq_s * r.num_streams + c.decode_context_s * r.stream_context


def queued_step_s(r: ReplicaLoad) -> float:
    """What the prompts queued ahead add to a step once they decode (`queued_streams`)."""
    c = r.coefficients
    return c.decode_seq_s * r.queued_streams + c.decode_context_s * r.queued_context


def background_chunk(r: ReplicaLoad) -> int:
    """The first background prefill's chunk per step (the engine's default when unknown)."""
    budget = max(1, r.chunk_tokens - r.num_streams)
    return max(1, min(budget, r.background_chunk_tokens or DEFAULT_YIELD_TOKENS))


def steps_for(tokens: float, phases: list[tuple[float, float]]) -> int:
    """Steps to compute `tokens` at `phases` of (tokens per step, steps), the last phase's
    steps unbounded."""
    if tokens <= 0:
        return 0
    done = 0
    for i, (rate, num_steps) in enumerate(phases):
        rate = max(1.0, rate)
        if i == len(phases) - 1 or tokens <= rate * num_steps:
            return done + math.ceil(tokens / rate)
        tokens -= rate * num_steps
        done += int(num_steps)
    raise AssertionError("unreachable")


def after(phases: list[tuple[float, float]], num_steps: int) -> list[tuple[float, float]]:
    """`phases` from step `num_steps` on."""
    out = []
    for i, (rate, steps) in enumerate(phases):
        if i == len(phases) - 1:
            out.append((rate, steps))
        elif steps > num_steps:
            out.append((rate, steps - num_steps))
        num_steps = max(0, num_steps - int(steps))
    return out


def tokens_in(num_steps: float, phases: list[tuple[float, float]]) -> float:
    """Tokens computed in the first `num_steps` steps at `phases` (as in `steps_for`)."""
    total = 0.0
    for i, (rate, steps) in enumerate(phases):
        take = num_steps if i == len(phases) - 1 else min(num_steps, steps)
        total += max(1.0, rate) * take
        num_steps -= take
        if num_steps <= 0:
            break
    return total


@dataclass(slots=True)  # not frozen: built per candidate, and a frozen one builds slower
class _Lanes:
    """A replica's queue as two lanes, and what a step costs before its prompt tokens."""

    c: StepCoefficients
    budget: int
    fg_tokens: int
    fg_work: int
    bg_tokens: int
    bg_work: int
    b: int  # the queued background's chunk per step
    bg_steps: int  # until the queued background is done
    per: float  # `per_step_s`
    queued: float  # `queued_step_s`

    @classmethod
    def of(cls, r: ReplicaLoad) -> _Lanes:
        b = background_chunk(r)
        return cls(r.coefficients, max(1, r.chunk_tokens - r.num_streams),
                   max(0, r.queue_tokens - r.background_tokens), max(0, r.queue_work - r.background_work),
                   r.background_tokens, r.background_work, b,
                   math.ceil(r.background_tokens / b) if r.background_tokens else 0, per_step_s(r), queued_step_s(r))

    def fg_phases(self, own_chunk: int = 0, own_steps: int = 0) -> list[tuple[float, float]]:
        """The foreground lane's tokens per step: beside the queued background, beside a
        priced background prompt, then alone."""
        phases = [(self.budget - self.b, self.bg_steps)]
        if own_chunk:
            phases.append((self.budget - own_chunk, own_steps))
        return [*phases, (self.budget, 0)]

    @property
    def queue_cost(self) -> float:
        return token_cost(self.c, self.fg_tokens + self.bg_tokens, self.fg_work + self.bg_work)

    def room(self, phases: list[tuple[float, float]], queue_steps: int) -> int:
        """Prompt tokens the foreground queue's last step leaves free (0: no foreground queue)."""
        return max(0, int(tokens_in(queue_steps, phases) - self.fg_tokens)) if self.fg_tokens else 0

    def bg_cost(self, num_steps: int) -> float:
        """The queued background's tokens computed in the first `num_steps` steps."""
        return _share(self.c, min(self.bg_tokens, num_steps * self.b), self.bg_tokens, self.bg_work)


def drain(r: ReplicaLoad, own: Own | None = None) -> Drain:
    """`r`'s queue, then `own` in its lane; see the module's docstring."""
    if r.queue_tokens <= 0:  # the common case, priced per candidate: nothing ahead
        return _alone(r, own)
    lanes = _Lanes.of(r)
    if own is None:
        return _queue_only(r, lanes)
    if own.background_chunk is None:
        return _foreground(r, lanes, own)
    return _background(lanes, own)


def _alone(r: ReplicaLoad, own: Own | None) -> Drain:
    """`own` on a replica with no prompt queued: `_foreground` or `_background` with
    both lanes empty, without building them."""
    if own is None or own.tokens <= 0:
        return Drain(0.0, 0, 0, 0.0)
    budget = max(1, r.chunk_tokens - r.num_streams)
    rate = max(1, budget - r.queued_streams) if own.background_chunk is None else max(1, min(budget, own.background_chunk))
    steps = math.ceil(own.tokens / rate)
    step = per_step_s(r) + (queued_step_s(r) if own.background_chunk is None else 0.0)
    seconds = steps * step + token_cost(r.coefficients, own.tokens, own.work)
    return Drain(seconds, steps, steps, seconds, steps, seconds)


def _queue_only(r: ReplicaLoad, lanes: _Lanes) -> Drain:
    bg_steps = lanes.bg_steps
    if lanes.bg_tokens and not lanes.fg_tokens and r.num_streams == 0 and r.queued_streams == 0:
        bg_steps = math.ceil(lanes.bg_tokens / lanes.budget)  # nothing decodes: the budget is its own
    fg_steps = steps_for(lanes.fg_tokens, lanes.fg_phases())
    busy_steps = max(fg_steps, bg_steps)
    busy_s = busy_steps * lanes.per + lanes.queue_cost
    if 0 < fg_steps < busy_steps:  # the background lane trails on alone at its chunk
        fg_s = fg_steps * lanes.per + token_cost(lanes.c, lanes.fg_tokens, lanes.fg_work) + lanes.bg_cost(fg_steps)
        return Drain(fg_s, fg_steps, busy_steps, busy_s)
    return Drain(busy_s, busy_steps, busy_steps, busy_s)


def _foreground(r: ReplicaLoad, lanes: _Lanes, own: Own) -> Drain:
    """Done with the foreground lane's last chunk. It starts in the queue's last step
    where that leaves room (a step computes as many prompts as its budget holds); its
    later chunks also decode the prompts queued ahead, which are streams by then. Priced
    a step of its own behind them instead, a short prompt behind another looked twice
    the 100 ms both took in one step."""
    phases = lanes.fg_phases()
    queue_steps = steps_for(lanes.fg_tokens, phases)
    first = min(own.tokens, lanes.room(phases, queue_steps))
    later = steps_for(own.tokens - first, [(rate - r.queued_streams, n) for rate, n in after(phases, queue_steps)])
    own_steps, done_at = later + (1 if first else 0), queue_steps + later
    own_cost = token_cost(lanes.c, own.tokens, own.work)
    seconds = (done_at * lanes.per + later * lanes.queued + token_cost(lanes.c, lanes.fg_tokens, lanes.fg_work)
               + own_cost + lanes.bg_cost(done_at))
    bg_left = lanes.bg_tokens - min(lanes.bg_tokens, done_at * lanes.b)  # runs on, at its chunk
    busy_steps = done_at + (math.ceil(bg_left / lanes.b) if bg_left > 0 else 0)
    busy_s = busy_steps * lanes.per + later * lanes.queued + lanes.queue_cost + own_cost
    own_s = own_steps * lanes.per + later * lanes.queued + own_cost + lanes.bg_cost(own_steps)
    return Drain(seconds, done_at, busy_steps, busy_s, own_steps, own_s)


def _background(lanes: _Lanes, own: Own) -> Drain:
    """The reserve is the queued background's until it is done, and the foreground lane
    takes the rest of the budget: the priced prompt starts once either lane ahead is
    empty (in the foreground's last step if it leaves room), then runs at its chunk."""
    chunk = max(1, min(lanes.budget, own.background_chunk))
    own_steps = math.ceil(own.tokens / chunk)
    phases = lanes.fg_phases(chunk, own_steps)
    queue_steps = steps_for(lanes.fg_tokens, phases)
    begin = lanes.bg_steps
    if queue_steps < lanes.bg_steps:
        first = min(chunk, lanes.room(phases, queue_steps), own.tokens)
        begin = queue_steps - 1 if first > 0 else queue_steps
        own_steps = 1 + math.ceil((own.tokens - first) / chunk) if first > 0 else own_steps
    done_at = begin + own_steps
    own_cost = token_cost(lanes.c, own.tokens, own.work)
    fg_done = min(lanes.fg_tokens, tokens_in(done_at, phases))
    seconds = (done_at * lanes.per + own_cost + lanes.bg_cost(done_at)
               + _share(lanes.c, fg_done, lanes.fg_tokens, lanes.fg_work))
    busy_steps = max(done_at, queue_steps, lanes.bg_steps)
    busy_s = busy_steps * lanes.per + lanes.queue_cost + own_cost
    return Drain(seconds, done_at, busy_steps, busy_s, own_steps, own_steps * lanes.per + own_cost)


def share_of(busy_s: float, seconds: float) -> float:
    """The share of a queue that drains in `busy_s` (its `Drain.busy_s`) computed
    `seconds` after its state was taken, at that pace (0 to 1): what a heartbeat that old
    no longer shows."""
    if seconds <= 0.0:
        return 0.0
    return 1.0 if busy_s <= seconds else seconds / busy_s


def own_prompt(start: int, end: int, chunk: int, background_chunk: int | None = None) -> Own:
    """The prompt positions [start, end) as a lane's entry, its work at `chunk` tokens a step."""
    _, tokens, work = prefill_work(start, end, max(1, background_chunk or chunk))
    return Own(tokens, work, background_chunk)


def _share(c: StepCoefficients, done: float, tokens: int, work: int) -> float:
    """The cost of the first `done` of a lane's `tokens` (its work in proportion)."""
    if tokens <= 0 or done <= 0:
        return 0.0
    return token_cost(c, done, work * done / tokens)
