"""What each way of running one request would cost: TTFT, its TPOT, and the TPOT of the
streams already decoding beside it, priced from the replicas' learned step models.

A replica's step takes (workers/engine/cost_model.py)

    c0 + c1 * prompt tokens + c2 * prefill attention work + c3 * decode seqs + c4 * decode context

and its scheduler fills each step's token budget with its streams' decode tokens first,
then prompt chunks in arrival order, a chunk kept every step for the first background
prefill: the foreground and background prompts drain side by side
(`router/queue_drain.py`). From that and the replica's queue (`ReplicaLoad`) follow, per
candidate:

- `remote`: the prompt prefills on a prefill replica behind its queue, the KV's exposed
  transfer tail follows (at least what a transfer to the same decode replica still
  unacknowledged has waited: `ReplicaLoad.tail_to`). The decode replica takes part at two step boundaries (it
  reserves the KV blocks before the prefill starts and commits them once they are
  written) and reports the first token with the step after, so a decode replica busy
  with long prompt chunks adds about two of its steps. A request run whole on the
  prefill replica decodes there beside the prompt's chunks: those streams are priced
  too (`Prediction.host_streams_tpot_s`).
- `local`: the prompt prefills on the decode replica behind its queue, each step also
  decoding the streams there (which wait for those steps), and its own chunks also
  decoding the prompts queued ahead of it there, which will be streams by then.
- `background`: as `local`, but in a step that decodes streams the prompt takes only a
  chunk sized so the step stays inside the streams' TPOT objective (prefill deflection),
  every step, beside the foreground prompts, once the background prefills ahead of it
  are done; priced as if streams stay beside it to the end (new ones keep arriving where
  streams decode).
- `whole`: the request runs, prefill and decode, on a prefill replica, as `local` does
  on a decode replica (beside the requests already run whole there, its streams), its
  gaps stretched by the remote prefills that keep arriving there (`prompt_share`). Those come
  in lumps: one long prompt, computed in a few full-budget chunks, stalls the stream for
  seconds, which a mean stretch prices at a few percent. `burst_miss_chance`
  (router/burst_risk.py) is the
  chance that a prompt too long for the request's TPOT slack lands during its decode.

A stream's TPOT is its mean gap over the tokens it has left, so the prediction for the
streams beside a prefill averages the slower mixed steps into the rest of their life
(and the request's own decode into as many of their gaps as it generates tokens),
and it is held to what the tightest of them still in reach can afford
(`bystanders.stream_objective_s`: a stream's objective less what its gaps so far already took,
spread over its tokens left; one that cannot make it even with nothing added is past
reach and sets nothing); a decode step there is the expected gap (`expected_gap_s`):
the step of the moment blended with the gap the replica's streams saw lately, and a step
that also computes prompt tokens is stretched as much (`as_streams_see`).

Replicas of one machine share its cores and memory bandwidth: a `ReplicaLoad`'s step
model already prices its steps beside the other replicas of its node that are busy now
(`ReplicaLoad.node_busy`, each slowing it by the step model's `node_contention`), and a
remote prefill on an idle replica of the decode replica's own node slows that replica's
streams while it runs, which a separate pool on the same machine does not avoid.
A replica's steps and the gaps its streams see are `router/replica_steps.py`. Everything
here is pure arithmetic over plain data: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from router.candidate import Candidate, Kind, Prediction, RequestShape
from router.queue_drain import Drain, Own, Phases, drain, own_prompt
from router.replica_load import ReplicaLoad
from router.replica_steps import (
    added_contention,
    as_streams_see,
    current_step_s,
    decode_step_s,
    expected_gap_s,
    in_flight_wait_s,
    joins_node,
    prompt_share,
)

STREAM_TPOT_MARGIN = 0.9  # a background chunk aims this far inside the streams' objective
IDLE_CHUNK_DECODE_STEPS = 1.0  # a background chunk on a replica with no streams yet (`_joiner_chunk`)


def foreground(r: ReplicaLoad, start: int, end: int) -> Own:
    """Prompt positions [start, end) in `r`'s foreground lane, at the chunks its streams
    and the prompts queued ahead leave of the budget."""
    return own_prompt(start, end, max(1, r.chunk_tokens - r.num_streams - r.queued_streams))


def _mean_gap(gaps: float, slow_steps: float, slow_step_s: float, after_step_s: float) -> float:
    """The mean of `gaps` gaps, the first `slow_steps` of them (at most all) `slow_step_s`
    long and the rest `after_step_s`."""
    return _phased_mean(gaps, ((slow_steps, slow_step_s),), after_step_s)


def _phased_mean(gaps: float, phases: Phases, after_step_s: float) -> float:
    """The mean of `gaps` gaps through `phases` in order (as many of their steps as
    `gaps` reaches), the rest `after_step_s` long."""
    total, left = 0.0, gaps
    for steps, step in phases:
        take = min(max(steps, 0.0), left)
        total, left = total + take * step, left - take
    return (total + left * after_step_s) / gaps


def _skip(phases: Phases, seconds: float) -> Phases:
    """`phases` from `seconds` on."""
    out = []
    for steps, step in phases:
        span = steps * step
        if seconds >= span:
            seconds -= span
            continue
        out.append((steps - seconds / step if step > 0 else steps, step))
        seconds = 0.0
    return tuple(out)


def _num_steps(phases: Phases) -> float:
    return sum(steps for steps, _ in phases)


def _streams_tpot(r: ReplicaLoad, phases: Phases, after_step_s: float,
                  joiner: RequestShape | None = None) -> float:
    """The streams' mean gap over what they have left: through the slow `phases`, then
    the rest; with a `joiner`, the rest at `after_step_s` only while it decodes beside
    them (`_beside_joiner`). Priced at the phases' mean step, two streams 15 tokens from
    their end beside a 1,500-token foreground prompt (4 steps of 330 ms) and a
    background prompt trailing on after it (53 of 43 ms) looked 63 ms a token; one saw
    121 (bench cluster run CB, load shift)."""
    if r.num_streams == 0:
        return 0.0
    left = max(r.stream_tokens_left, 1.0)
    if joiner is not None:
        after_step_s = _beside_joiner(joiner, r, left - min(_num_steps(phases), left), after_step_s)
    return _phased_mean(left, phases, after_step_s)


def _beside_joiner(req: RequestShape, r: ReplicaLoad, gaps: float, with_s: float) -> float:
    """The mean of the streams' next `gaps` gaps on `r` once `req` decodes there: at
    `with_s` for the gaps it decodes beside them, at the gap they see without it after it
    leaves. Priced as if it stayed to their end, a 1,470-token prompt generating 8 tokens
    made the four streams beside it, 20 tokens from theirs, look 3 ms a token slower for
    all of them; sent remote it cost them more than it was itself worth, and it ran
    whole on the prefill replica, where the next remote prefills stalled it (bench
    cluster, tight-TPOT cell: all 6 long prompts run whole missed; 5 of the 6 sent
    remote met)."""
    beside = min(gaps, float(max(req.max_tokens - 1, 1)))
    if gaps <= 0.0 or beside >= gaps:
        return with_s
    return (beside * with_s + (gaps - beside) * expected_gap_s(r)) / gaps


def _queued_tpot(r: ReplicaLoad, own_steps: float, own_step_s: float, after_step_s: float) -> float:
    """The mean gap of the prompts queued ahead on `r` (`queued_streams`), which decode
    beside this prompt's `own_steps` chunks and then at `after_step_s`."""
    if r.queued_streams == 0:
        return 0.0
    return _mean_gap(max(r.queued_tokens_left - 1.0, 1.0), own_steps, max(own_step_s, after_step_s), after_step_s)


def _own_tpot(req: RequestShape, d: ReplicaLoad, queue_left: Phases, gap_with_s: float | None = None) -> float:
    """This request's mean gap on `d`, its queue's chunks still running there for
    `queue_left` (`gap_with_s`: `_gap_with(req, d)` when already known)."""
    after = _gap_with(req, d) if gap_with_s is None else gap_with_s
    return _phased_mean(max(req.max_tokens - 1, 1), tuple((n, max(step, after)) for n, step in queue_left), after)


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """What every remote candidate of one request shares, priced once: its decode
    replica's queue and steps, and the streams there beside its decode."""

    queue: Drain  # `drain(d)`
    step_s: float  # `current_step_s(d)`
    after_step_s: float  # a decode step of its streams and this request's
    gap_with_s: float  # `_gap_with(req, d)`: the streams' expected gap once it decodes there
    streams_phases: Phases  # its queue's steps as the streams wait through them (`as_streams_see`)
    streams_tpot_s: float  # their mean gap through those, with this request beside them


def decode_side(req: RequestShape, d: ReplicaLoad, d_queue: Drain | None = None) -> DecodeSide:
    queue = d_queue or drain(d)
    gap_with = _gap_with(req, d)
    busy = as_streams_see(d, queue.phases)
    return DecodeSide(queue, current_step_s(d, queue),
                      decode_step_s(d, req.num_sequences * req.decode_cost, req.num_sequences * req.prompt_len),
                      gap_with, busy, _streams_tpot(d, busy, gap_with, req))


def remote(req: RequestShape, p: ReplicaLoad, d: ReplicaLoad, prefill_cached: int, decode_cached: int,
           side: DecodeSide | None = None) -> Candidate:
    """Prefill on `p`, decode on `d` (`side`: `decode_side(req, d)` when already known)."""
    side = side or decode_side(req, d)
    joins = joins_node(p, d)
    during_x = added_contention(d, joins)  # while `p` prefills beside it
    start = _start(req, prefill_cached)
    prefill = drain(p, foreground(p, start, req.prompt_len))
    num_bytes = max(0, req.prompt_len - _start(req, decode_cached)) * d.kv_bytes_per_token
    tail = p.tail_to(d.address, num_bytes)
    # half a step to reserve, half to commit, one to report the first token
    ttft = prefill.seconds + tail + 2.0 * max(side.step_s * during_x, 0.5 * side.after_step_s)
    tpot = _own_tpot(req, d, _skip(side.queue.phases, ttft), side.gap_with_s)
    streams = side.streams_tpot_s
    if during_x > 1.0 and d.num_streams:  # the prefill slows the streams of its node's decode replica
        gap = expected_gap_s(d) * during_x
        busy = side.streams_phases + ((prefill.seconds / gap if gap > 0 else 0.0, gap),)
        streams = _streams_tpot(d, busy, side.gap_with_s, req)
    host_gap = expected_gap_s(p)
    host = max(_streams_tpot(p, as_streams_see(p, prefill.phases), host_gap),
               _queued_tpot(p, prefill.own_steps, prefill.own_step_s, host_gap))
    return Candidate("remote", d.replica_id, p.replica_id, Prediction(ttft, tpot, streams, tail, host),
                     num_streams=d.num_streams, host_streams=p.num_streams + p.queued_streams,
                     overdue_x=p.overdue.get("disagg", 1.0), computed_tokens=req.prompt_len - start,
                     prefill_done_s=prefill.seconds, prefill_own_s=prefill.own_s)


def local(req: RequestShape, d: ReplicaLoad, cached: int, d_queue: Drain | None = None) -> Candidate:
    """Prefill on `d` in the foreground, behind its queue (from the next step boundary),
    then decode there."""
    start = _start(req, cached)
    prefill = drain(d, foreground(d, start, req.prompt_len))
    return _on_decode_replica("local", req, d, prefill, d_queue, computed_tokens=req.prompt_len - start)


def _on_decode_replica(kind: Kind, req: RequestShape, d: ReplicaLoad, prefill: Drain, d_queue: Drain | None,
                       chunk: int | None = None, computed_tokens: int = 0) -> Candidate:
    """A prompt prefilled on `d` (`prefill`, its drain there) and decoded there: its own
    gaps beside the prompt chunks still running after its first token, and the streams'
    beside every prompt chunk from now on (the prompts queued ahead decode beside its own)."""
    phases = prefill.phases
    after = _gap_with(req, d)
    tpot = _own_tpot(req, d, phases[1:], after)
    streams = max(_streams_tpot(d, as_streams_see(d, phases), after, req),
                  _queued_tpot(d, prefill.own_steps, prefill.own_step_s, after))
    joining = d.arrival_rate * prefill.own_s + bisect.bisect_left(d.incoming_due_s, prefill.seconds)
    if not streams and joining > 0.0:  # none decode there yet: those expected to join meanwhile (`_joiner_tpot`)
        streams = _joiner_tpot(req, prefill, after)
    ttft = prefill.seconds + in_flight_wait_s(d, d_queue)
    return Candidate(kind, d.replica_id, d.replica_id, Prediction(ttft, tpot, streams), chunk,
                     num_streams=d.num_streams + d.queued_streams, overdue_x=d.overdue.get("local", 1.0),
                     joining_streams=joining, computed_tokens=computed_tokens,
                     blocking_s=prefill.own_s if kind == "local" else 0.0)


def _joiner_tpot(req: RequestShape, prefill: Drain, after_step_s: float) -> float:
    """The mean gap of a request that starts decoding on a replica with no streams while a
    prompt's chunks run there (`Candidate.joining_streams`): on average it arrives half way
    through them, and it is taken to be as long as this one. Priced at nothing, a
    1,470-token prompt prefilled on an empty decode replica while three long prompts
    prefilling remotely were due there within its 1.2 s, and one of them decoded at 86 ms
    a token against 74 (bench cluster run BP, load shift)."""
    slow_steps = 0.5 * prefill.own_steps
    return _mean_gap(max(req.max_tokens - 1, 1), slow_steps, max(prefill.own_step_s, after_step_s), after_step_s)


def background_chunk(req: RequestShape, d: ReplicaLoad, stream_tpot_slo_s: float) -> int:
    """The prompt tokens a decoding step may take so that it stays inside the streams'
    objective as they wait through it, stretched by the prompts arriving there
    (`as_streams_see`): at least one token; at most the budget the streams leave.

    Sized on the bare step, the chunk that the scoring then priced past the streams'
    objective made every background candidate miss where prompts kept arriving: in
    load shifts replayed 20% slower than calibrated (13 runs, 195 long prompts), long
    prompts went remote to a queue already past their objective, and 133 met against
    the threshold rule's 163; sized as seen, 152. Replayed mixed traces (39,600
    requests) met 77 fewer, 60 of them in the tight-TPOT cell, where a margin 2%
    smaller alone meets 40 fewer."""
    seen_s = STREAM_TPOT_MARGIN * stream_tpot_slo_s * (1.0 - prompt_share(d))
    return _tokens_costing(req, d, seen_s - decode_step_s(d))


def _joiner_chunk(req: RequestShape, d: ReplicaLoad) -> int:
    """The chunk of a background prefill on a replica with no streams yet: prompt tokens
    costing `IDLE_CHUNK_DECODE_STEPS` of the decode step a request landing there takes.
    Sized as where streams decode (`background_chunk`, to 0.9 of their objective), the
    requests landing beside it decoded at the edge of their objective; simulated load
    shifts (23 traces, 4,104 long prompts) met 3,406 there, 3,595 / 3,680 / 3,593 / 3,437
    at 0.5 / 1 / 1.5 / 2 decode steps, and 3,519 with no such candidate."""
    return _tokens_costing(req, d, IDLE_CHUNK_DECODE_STEPS * decode_step_s(d, 1.0, req.prompt_len))


def _tokens_costing(req: RequestShape, d: ReplicaLoad, seconds: float) -> int:
    """This prompt's tokens that add `seconds` to one of `d`'s steps, in [1, the budget
    its streams leave]."""
    c = d.coefficients
    per_token = c.prefill_token_s + c.prefill_attention_s * req.prompt_len
    budget = max(1, d.chunk_tokens - d.num_streams)
    if per_token <= 0:
        return budget
    return int(max(1, min(budget, seconds / per_token)))


def background(req: RequestShape, d: ReplicaLoad, cached: int, stream_tpot_slo_s: float,
               d_queue: Drain | None = None) -> Candidate | None:
    """Prefill on `d` yielding to its streams; None when it has none and none are expected
    to join (then it is `local`). Its chunk runs every step, beside the foreground prompts
    (`router/queue_drain.py`), once the background prefills queued ahead of it are done;
    it is priced as if streams stay beside it to the end (on a replica that decodes, new
    ones keep arriving). On a replica with no streams yet but remote prefills due to land
    there, the engine gives it the whole budget until one lands: priced at its chunk
    (`_joiner_chunk`) all the same, its TTFT errs long, while the requests landing
    meanwhile decode beside its small chunks rather than a foreground prompt's full
    ones. Without it, long prompts found an idle decode replica with remote prefills due
    there, their foreground prefill priced at those missing, and they waited 3.2-3.4 s
    behind them on the prefill replica against a 3.4 s objective (bench cluster, load
    shift: 19 long prompts met against the threshold rule's 24, which spills them to the
    decode replica in the background)."""
    idle = d.num_streams == 0
    if idle and not d.incoming_due_s:
        return None
    chunk = background_chunk(req, d, stream_tpot_slo_s)
    start = _start(req, cached)
    if idle:
        chunk = min(chunk, _joiner_chunk(req, d))
        if req.prompt_len - start <= chunk:  # one chunk: it runs as `local` would
            return None
    prefill = drain(d, own_prompt(start, req.prompt_len, chunk, background_chunk=chunk))
    return _on_decode_replica("background", req, d, prefill, d_queue, chunk, req.prompt_len - start)


def whole(req: RequestShape, p: ReplicaLoad, cached: int) -> Candidate:
    """Prefill and decode on the prefill replica `p`, as `local` would on a decode replica:
    behind its queue, beside the requests already run whole there (its streams), and
    beside the remote prefills arriving there meanwhile (`expected_gap_s`)."""
    start = _start(req, cached)
    prefill = drain(p, foreground(p, start, req.prompt_len))
    return _on_decode_replica("whole", req, p, prefill, None, computed_tokens=req.prompt_len - start)


def _gap_with(req: RequestShape, d: ReplicaLoad) -> float:
    """The streams' expected gap on `d` once this request decodes beside them."""
    return expected_gap_s(d, req.num_sequences * req.decode_cost, req.num_sequences * req.prompt_len)


def _start(req: RequestShape, cached: int) -> int:
    return 0 if req.prompt_logprobs else min(cached, req.prompt_len - 1)


