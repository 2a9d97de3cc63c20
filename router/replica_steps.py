"""A replica's steps, and the gaps between tokens its streams see, priced from its learned
step model (workers/engine/cost_model.py):

    c0 + c1 * prompt tokens + c2 * prefill attention work + c3 * decode seqs + c4 * decode context

A stream's gap is the decode step of the moment blended with the gap the replica's
streams saw lately (`expected_gap_s`), stretched by the prompts arriving there; a step
that also computes prompt tokens is stretched as much (`as_streams_see`). A replica's
neighbours on its node slow its steps (`added_contention`). `router/predict.py` prices
each candidate route from these. Pure arithmetic over plain data: no clock, no I/O.
"""

from __future__ import annotations

from router.queue_drain import Drain, Phases, drain
from router.replica_load import ReplicaLoad
from workers.engine.cost_model import StepCoefficients

NOW_WEIGHT = 0.3  # of a replica's state now in a stream's expected gap; the rest is its recent past
MAX_PROMPT_SHARE = 0.9  # of a replica's time taken by arriving prompts, as a stream's gap prices it


def added_contention(r: ReplicaLoad, extra_busy: float) -> float:
    """How much slower `r`'s steps get with `extra_busy` more busy replicas on its node
    than its load counts now (1: none)."""
    kappa = r.coefficients.node_contention
    if extra_busy <= 0 or kappa <= 0:
        return 1.0
    return (1.0 + kappa * (r.node_busy + extra_busy)) / (1.0 + kappa * r.node_busy)


def joins_node(p: ReplicaLoad, d: ReplicaLoad) -> float:
    """1 when a prompt sent to `p` makes it a newly busy neighbour of `d`, else 0."""
    return 1.0 if p.shares_node_with(d) and not p.busy else 0.0


def step_s(c: StepCoefficients, prefill_tokens: float, prefill_work_: float, decode_seqs: float,
           decode_context: float) -> float:
    return (c.fixed_s + c.prefill_token_s * prefill_tokens + c.prefill_attention_s * prefill_work_
            + c.decode_seq_s * decode_seqs + c.decode_context_s * decode_context)


def decode_step_s(r: ReplicaLoad, extra_seqs: float = 0.0, extra_context: float = 0.0) -> float:
    """A step that only decodes the replica's streams (plus `extra_seqs`)."""
    return step_s(r.coefficients, 0, 0, r.num_streams + extra_seqs, r.stream_context + extra_context)


def expected_gap_s(r: ReplicaLoad, extra_seqs: float = 0.0, extra_context: float = 0.0) -> float:
    """The gap a stream on `r` should expect over the rest of its life: the decode step
    its streams (plus `extra_*`) take now, blended with the gap its streams saw lately in
    steps that only decoded, which counts the streams that kept arriving beside them (a
    request's TPOT averages over tens of steps; the state at one moment predicts it worse
    than the replica's recent past does), plus what the extra streams add; where its
    streams saw no gaps lately (a prefill replica), the decode step alone. Either way
    stretched by the prompts arriving there (`prompt_share`): the recent gap leaves out
    the steps that also prefilled, and the prompts that will arrive during a stream's life
    are in no queue yet."""
    return (decode_step_s(r, extra_seqs, extra_context) + recent_lag_s(r)) / (1.0 - prompt_share(r))


def recent_lag_s(r: ReplicaLoad) -> float:
    """What `expected_gap_s` adds to a step of `r` for the gaps its streams saw lately:
    their share (1 - `NOW_WEIGHT`) of how far those ran past its decode step now (less
    where they ran shorter); 0 where its streams saw no gaps lately. The extra streams a
    step decodes cost the same either way, so they cancel."""
    if r.recent_gap_s is None:
        return 0.0
    return (1.0 - NOW_WEIGHT) * (r.recent_gap_s - decode_step_s(r))


def as_streams_see(r: ReplicaLoad, phases: Phases) -> Phases:
    """`phases` (steps of `r`'s queue as its step model prices them) as the streams there
    wait through them: each step stretched as `expected_gap_s` stretches a decode step,
    by what the replica's recent gaps ran past its step model and by the prompts arriving
    meanwhile. Priced bare, a background prompt's chunk steps looked quicker to the
    streams than the gaps they were seeing anyway: on a replica whose recent gaps ran at
    33 ms against a 9 ms decode step, a prompt in 90-token chunks (18 ms steps) beside
    streams allowed 20 ms looked kinder to them than a remote prefill that adds one
    stream, and won."""
    if not phases:
        return phases
    lag = max(0.0, recent_lag_s(r))  # a prompt's step is never shorter than its step model says
    stretch = 1.0 / (1.0 - prompt_share(r))
    return tuple((steps, (step + lag) * stretch) for steps, step in phases)


def prompt_share(r: ReplicaLoad) -> float:
    """The share of `r`'s time that prompts take, arriving at the pace this router placed
    them there lately (at most `MAX_PROMPT_SHARE`). A stream there waits for their chunks:
    whatever its batch, its gaps stretch by 1 / (1 - share) on average."""
    c = r.coefficients
    share = r.prompt_token_rate * c.prefill_token_s + r.prompt_work_rate * c.prefill_attention_s
    return min(max(share, 0.0), MAX_PROMPT_SHARE)


def current_step_s(r: ReplicaLoad, queue: Drain | None = None) -> float:
    """The step the replica runs now: its queue's mixed steps (`queue`: `drain(r)` when
    already known), else its streams' decode steps, else nothing (an idle engine starts
    a step as soon as work arrives)."""
    if r.queue_tokens > 0:
        return (queue or drain(r)).step_s
    return decode_step_s(r) if r.num_streams > 0 else 0.0


def in_flight_wait_s(r: ReplicaLoad, queue: Drain | None = None) -> float:
    """What a prompt placed on `r` waits, on average, for the step in flight to end before
    its queue's steps begin: half that step where no foreground prompt is queued (a
    decode step, or one with a background chunk); none where one is, as its queue's first
    step is that step, already counted whole (or what is left of it) in the drain. Half a
    step more there, a short prompt behind another came in at 0.7x its prediction."""
    if r.queue_tokens > r.background_tokens:
        return 0.0
    return 0.5 * current_step_s(r, queue)
