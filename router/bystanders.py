"""What a candidate costs the requests it touches besides its own: the streams decoding
beside it (those in reach, and those just past it), the requests expected to join them
while its prompt's chunks slow their replica, and those that would wait behind it in the
decode replica's foreground lane.

Each is counted two ways for `router/auto_policy.py`: as expected goodput lost (how much
the candidate adds to a request's chance of missing its objective, from the spread of
the streams' recent outcomes around their predictions) and as a margin at risk
(`at_risk`: exp(-slack / SLACK_SCALE)). Which of the streams are still in reach, and
what the tightest of those can afford, is `stream_objective_s`.
"""

from __future__ import annotations

import bisect
import math

from router import replica_steps
from router.arrival_rate import WINDOW_S as ARRIVAL_WINDOW_S
from router.candidate import Prediction
from router.corrections import STREAMS, LearnedState
from router.replica_load import ReplicaLoad

# The relative error a prediction typically has: slack worth one such error leaves a
# request about a third as much at risk as none (the router's TTFT and TPOT predictions
# landed 0.2-0.25 off, median, on 2 shared cores).
SLACK_SCALE = 0.25
MAX_RISK_EXPONENT = 50.0


def stream_objective_s(d: ReplicaLoad, default_s: float, floor_s: float) -> tuple[float, int]:
    """The mean gap the streams on `d` still in reach can afford, and how many of them are
    past reach. A stream whose allowance is below `floor_s` (the gap it sees with nothing
    added, `expected_gap_s`) misses its objective whatever is placed beside it: it neither
    sets the others' objective nor counts as lost to any one route. `default_s` (this
    workload's objective) for the streams whose allowance is unknown (another router's,
    or any this router placed without one); infinity when every stream is past reach."""
    allowances = d.stream_allowances
    if not allowances:
        return default_s, 0
    past = bisect.bisect_left(allowances, floor_s)
    if past < len(allowances):
        return allowances[past], past
    return (default_s if d.num_streams + d.queued_streams > past else math.inf), past


def beside_streams(state: LearnedState, tpot_s: float, objective_s: float, at_stake: int, now: float,
                   untouched_s: float = 0.0) -> tuple[float, float]:
    """(ratio to their objective, expected goodput lost) of `at_stake` streams predicted
    to decode at `tpot_s` beside a candidate: their chance of missing beyond the one they
    have at `untouched_s`, the gap they see whatever this request does.

    Counted whole, a miss the streams were headed for anyway charged every candidate that
    touches them: where a decode replica's gaps ran at 37-41 ms against a 29.74 ms
    objective, a remote prefill that adds one stream there cost 1.2-1.6 requests, and
    the long prompt ran whole on the prefill replica instead (bench cluster, tight_tpot),
    where the remote prefills after it stalled it to 300-460 ms a token."""
    return tpot_s / objective_s, at_stake * _added_miss(state, tpot_s, objective_s, untouched_s, now)


def past_reach_loss(state: LearnedState, r: ReplicaLoad, past_reach: int, tpot_s: float, untouched_s: float,
                    now: float) -> float:
    """What a candidate adds to the chance of missing of the streams on `r` past reach
    that still have budget left, each held to the largest such allowance (the nearest to
    reach). Past reach is judged on a prediction, which lands a fifth to a quarter off:
    a stream just past it still makes its objective about as often as not, unless a
    prompt's chunks stall it. Counted as lost to every route alike, six streams on a
    decode replica whose decode step alone was 19.6 ms against their 19.5 ms allowance
    cost nothing to a 1,496-token prompt prefilled beside them (72 ms a token predicted
    for the rest of their lives) or sent remote (30 ms while it decoded beside them), and
    it prefilled there. Counting them (simulated `bench cluster` mixed traces, 6,600
    requests a cell): +174 good requests in the tight-TPOT cell, +35 in the tight one,
    -2 and -7 in the balanced and loose ones."""
    live = [a for a in r.stream_allowances[:past_reach] if a > 0.0]
    if not live:
        return 0.0
    return len(live) * _added_miss(state, tpot_s, live[-1], untouched_s, now)


def _added_miss(state: LearnedState, tpot_s: float, objective_s: float, untouched_s: float, now: float) -> float:
    """How much a stream's chance of missing `objective_s` grows from the gap it sees
    untouched (`untouched_s`) to the one predicted beside a candidate (`tpot_s`)."""
    return max(0.0, _miss(state, tpot_s, objective_s, now) - _miss(state, untouched_s, objective_s, now))


def _miss(state: LearnedState, tpot_s: float, objective_s: float, now: float) -> float:
    """A stream's chance of missing `objective_s` at a predicted `tpot_s`, by how far the
    streams' outcomes landed from their predictions (`corrections.STREAMS`): the same
    streams whichever way the new prompt runs, so every route weighs them alike."""
    if tpot_s <= 0.0:
        return 0.0
    chance = state.chance_within("tpot", STREAMS, tpot_s, objective_s, now)
    return min(1.0, max(0.0, tpot_s / objective_s - 1.0)) if chance is None else 1.0 - chance


def untouched_gap_s(r: ReplicaLoad, state: LearnedState, now: float) -> float:
    """The gap the streams on `r` see with nothing added (`replica_steps.expected_gap_s`),
    rescaled as their TPOT is."""
    return replica_steps.expected_gap_s(r) * state.factor("tpot", STREAMS, r.replica_id, now)


def joiners_loss(state: LearnedState, tpot_s: float, objective_s: float, joining: float, untouched_s: float,
                 now: float) -> float:
    """The requests expected to start decoding beside a prompt prefilled on the decode
    replica while its chunks slow the steps there (`Candidate.joining_streams`), each as
    far as the candidate adds to its chance of missing this workload's objective (they
    arrive with their whole budget). Whichever way their own prompts run, they decode
    on that replica. Left out of the loss, streams already past reach there made a
    foreground prefill look free: each one stretched the replica's gaps for the requests
    arriving after it, which were then past reach too, and long prompts kept prefilling
    there until those 16-token requests decoded at 100-270 ms a token against 68 (bench
    cluster, load shift)."""
    return joining * _added_miss(state, tpot_s, objective_s, untouched_s, now)


def joiners_risk(prediction: Prediction, joining: float, slo_tpot_s: float) -> float:
    """The margin of the requests expected to join the streams while the candidate's
    chunks slow that replica, where every stream there now is past reach. Those requests
    arrive with their whole budget, so they are never past reach themselves; they are held
    to this workload's objective. Without them, a decode replica whose streams had all
    been stretched past a tight TPOT objective saw local and remote prefill tie on what
    they cost (this request misses on both), local won on its shorter TTFT, and every
    short prompt after prefilled there too, keeping the gaps stretched (bench cluster,
    tight_tpot: auto 14 good requests against 20 disaggregated)."""
    return joining * at_risk(1.0 - prediction.streams_tpot_s / slo_tpot_s)


def waiters_loss(blocking_s: float, objectives: tuple[tuple[float, int], ...]) -> float:
    """The requests expected to miss their TTFT objective waiting behind a prompt that
    holds the decode replica's foreground lane for `blocking_s`: they arrive as they did
    over the last window, each waits for what is left of the prompt's prefill, and those
    arriving more than their objective before its end miss. A remote candidate that
    would stall a request run whole on its prefill replica loses that request; priced
    without the arrivals, a 1,496-token prompt then prefilled on the decode replica, and
    the ten requests that arrived in the next 1.5 s queued behind it (bench cluster,
    balanced). The arrivals could have gone remote instead; where that route is free,
    a foreground prefill of seconds is the wrong call anyway."""
    return sum([n * max(0.0, blocking_s - objective) for objective, n in objectives]) / ARRIVAL_WINDOW_S


def queue_waiters_loss(prompt_rate: float, done_s: float, own_s: float, objective_s: float) -> float:
    """The requests expected to miss their TTFT objective because a remote prompt that
    misses its own joins the prefill replica's queue: those placed there after it (as
    many per second as lately, `prompt_rate`), taken to be like it (`objective_s`, and a
    prefill as long as its own `own_s`). One arriving t from now starts its prefill once
    this prompt's is done (`done_s`, the queue ahead included) and misses when
    `done_s` + `own_s` - t passes `objective_s`; this prompt's own chunks push those
    arriving in a span of up to `own_s` past that.

    Counted only as the prompt's own chance of missing, a prompt sent remote at a
    queue that already ran past its objective looked cheaper than a background prefill
    on the decode replica that met it, and the queue kept growing: in a load shift to
    110% of one replica's prefill rate, 13 of 15 long prompts went remote and 9 missed by
    5-15%, where the threshold rule, spilling every other one to the decode replica in
    the background, met 14 (bench cluster run CW)."""
    return prompt_rate * min(max(0.0, done_s + own_s - objective_s), own_s)


def waiters_risk(blocking_s: float, objectives: tuple[tuple[float, int], ...]) -> float:
    """The margin of the requests expected to arrive at the decode replica while this
    candidate's prompt holds its foreground lane: as many as arrived there over an equal
    time lately, each held to its own TTFT objective, each waiting half of that time on
    average. A 1,496-token prompt that met its objectives on both routes prefilled on the
    decode replica for 1.5 s, and the five short prompts after it (a 165 ms TTFT objective)
    found both routes late and missed; the prefill pool would have taken it as every fixed
    configuration sends it there (bench cluster, tight_ttft, run BC)."""
    share = blocking_s / ARRIVAL_WINDOW_S
    wait = 0.5 * blocking_s
    return share * sum([n * at_risk(1.0 - wait / objective) for objective, n in objectives])


def at_risk(slack: float) -> float:
    """exp(-slack / SLACK_SCALE), its exponent capped (a prediction far past its objective)."""
    return math.exp(min(-slack / SLACK_SCALE, MAX_RISK_EXPONENT))
