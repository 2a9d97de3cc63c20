"""`auto`: the route that maximises goodput, from predicted TTFT and TPOT against the SLO.

The decode replica is already chosen (prefix affinity, then load; router/placement.py).
The candidates, each priced by router/predict.py and rescaled by this router's learned
corrections (router/corrections.py) and, for TTFT, by how overdue the oldest prompt still
waiting on the same route and replica is (`ReplicaLoad.overdue`):

- `remote` on each of the (at most 4) least-loaded healthy prefill replicas,
- `local` on the decode replica, in the foreground,
- `background` on the decode replica at the chunk size that keeps its streams inside
  their TPOT objective (only while it has streams),
- `whole` on a prefill replica, beside the requests already run whole there (only when
  the placement offers one); its chance
  of meeting the SLO also counts the long remote prefills that may land beside it there
  (`router/burst_risk.py`).

A candidate meets the SLO when its TTFT and this request's TPOT meet the workload's and
the TPOT the streams beside it will see meets theirs: what the tightest of them still in
reach can afford. A remote prefill's chunks also stall the streams on its prefill
replica (requests run whole there): they count as streams beside it too. A stream that
would miss its objective even with nothing added beside it (it needs a smaller gap than
the replica's decode step) is past reach: it does not set the others' objective (one
such stream made every route look as if it broke all of them, and sized background
chunks at one token), and it counts only as far as a candidate adds to its chance of
missing its own allowance (a prediction lands a fifth off, so one just past reach still
makes it about as often as not), none once it has no budget left. The candidate that loses the least
expected goodput wins (this request, plus each stream beside it as far as the candidate
adds to its chance of missing, and so each request expected to join them while a prompt
prefilled there slows their steps, plus, for a foreground prefill on the decode replica, the
requests expected to arrive there and wait behind it past their TTFT objective:
`Candidate.blocking_s`); of equal ones, the one least at risk should the predictions be
off: the sum, over every request it touches (this request's TTFT and TPOT, and each stream beside it,
including those expected to join while the candidate's prompt chunks slow that replica,
`Candidate.joining_streams`, who count even where every stream there now is past reach;
and, for a foreground prefill there, the TTFT of the prompts placed there meanwhile, who
wait behind it: `Candidate.blocking_s`), of exp(-slack / `bystanders.SLACK_SCALE`), a slack fraction
being 1 - predicted / objective. A margin counts once per request it protects, so a long prompt
that every route serves in time goes where it leaves six streams 70% of their budget
rather than 40%, even where that costs its own TPOT a few points of slack (leximin over
the margins alone took the other, and the background prefill then held the decode
replica for 2.5 s); and a background prefill that keeps six streams 40% inside for 4.5 s
loses to a remote one that keeps them 27% inside where eighteen more requests will
arrive meanwhile.
Each term is the chance of missing (`LearnedState.chance_within`): from how far the
route's recent outcomes landed from their predictions once the router has measured
enough of them, and before that from a prior spread (`corrections.PRIOR_SPREAD`): slack
is only worth what the route's spread leaves of it. (Without a spread, as in a bare
`LearnedState`, the predictions are taken as exact: a candidate that meets the SLO loses
nothing, this request counts whole when it misses, and each stream pushed over its
objective counts in proportion to how far.)

Exploration: where both routes meet the SLO and the other route's measurements are
stale, a request whose id hashes into the `explore_fraction` bucket takes the other
route, so a route abandoned for being slow is measured again once it recovers.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from router import predict, replica_steps
from router.burst_risk import burst_miss_chance
from router.bystanders import (
    at_risk,
    beside_streams,
    joiners_loss,
    joiners_risk,
    past_reach_loss,
    queue_waiters_loss,
    stream_objective_s,
    untouched_gap_s,
    waiters_loss,
    waiters_risk,
)
from router.candidate import Candidate, Prediction
from router.corrections import EMPTY, STREAMS, LearnedState, tpot_key
from router.policy import Alternative, RouteContext, RouteDecision, RoutingPolicy
from router.queue_drain import Drain, drain
from router.replica_load import ReplicaLoad

EXPLORE_BUCKETS = 10_000
REASON_BY_KIND = {"remote": "slo-disagg", "local": "slo-local", "background": "protect-streams",
                  "whole": "slo-local"}


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    prediction: Prediction  # corrected
    meets: bool
    slack: tuple[float, ...]  # ascending slack fractions (1 - predicted / objective)
    loss: float  # expected goodput lost: 0..1 for this request plus the streams' share
    risk: float = 0.0  # sum over the requests it touches of exp(-slack / SLACK_SCALE)


def candidates(ctx: RouteContext) -> list[Candidate]:
    """Every way this request may run, raw predictions (no corrections)."""
    if ctx.decode is None:
        return []
    req, d = ctx.shape, ctx.decode
    d_queue = drain(d)  # priced once: every candidate looks at it
    out = [predict.local(req, d, ctx.num_cached_tokens, d_queue)]
    slow = background_candidate(ctx, d_queue)
    if slow is not None:
        out.append(slow)
    out += remote_candidates(ctx, d_queue)
    if ctx.whole is not None:
        out.append(predict.whole(req, ctx.whole, ctx.whole_cached_tokens))
    return out


def background_candidate(ctx: RouteContext, d_queue: Drain) -> Candidate | None:
    """In the background on the decode replica (`predict.background`); needs `ctx.decode`."""
    return predict.background(ctx.shape, ctx.decode, ctx.num_cached_tokens, chunk_objective_s(ctx), d_queue)


def remote_candidates(ctx: RouteContext, d_queue: Drain, limit: int | None = None) -> list[Candidate]:
    """Remote on each (the first `limit`) of the context's prefill replicas, least loaded
    first; none without a healthy one (`auto` drops them when the decode replica has no
    room). Needs `ctx.decode`."""
    if ctx.num_healthy_prefill == 0:
        return []
    req, d = ctx.shape, ctx.decode
    side = predict.decode_side(req, d, d_queue)
    pairs = list(zip(ctx.prefills, ctx.prefill_cached_tokens, strict=True))[:limit]
    return [predict.remote(req, p, d, hit, ctx.num_cached_tokens, side=side) for p, hit in pairs]


def stream_slo_s(ctx: RouteContext, floor_s: float = 0.0, r: ReplicaLoad | None = None) -> tuple[float, int]:
    """The mean gap the streams on the decode replica (or `r`) still in reach can afford,
    and how many are past reach (`bystanders.stream_objective_s`: those that need less than
    `floor_s`, the gap they see with nothing added); this workload's TPOT objective where
    no stream's allowance is known."""
    default = ctx.slo.tpot_ms / 1000.0
    r = r or ctx.decode
    if r is None:
        return default, 0
    return stream_objective_s(r, default, floor_s)


def chunk_objective_s(ctx: RouteContext) -> float:
    """The mean gap a background prefill's chunk on the decode replica is sized to keep:
    what the tightest stream there still in reach of the decode step alone can afford (as
    `_streams_objective` judges reach when scoring); where every stream there is past
    reach, this workload's objective, which the requests arriving to decode there
    meanwhile bring; none (the whole budget) where even that is below the decode step, as
    a chunk sized to an objective nobody can meet protects nobody.

    Judged against the expected gap, which counts the prompts placed there lately, every
    stream on a replica whose gaps those prompts had stretched looked past reach, the
    chunk took the whole budget, and the gaps stretched further: a 1,665-token prompt ran
    in 509-token chunks beside three streams allowed 86 ms a token, which then decoded at
    230-390 ms (bench cluster, load shift)."""
    d = ctx.decode
    if d is None:
        return ctx.slo.tpot_ms / 1000.0
    floor = replica_steps.decode_step_s(d)
    objective, _ = stream_slo_s(ctx, floor)
    if math.isfinite(objective):
        return objective
    own = ctx.slo.tpot_ms / 1000.0
    return own if own >= floor else math.inf


def streams_host(ctx: RouteContext, candidate: Candidate) -> ReplicaLoad | None:
    """The replica whose streams a candidate decodes beside: the prefill replica for a
    request run whole there, else the decode replica."""
    return ctx.whole if candidate.kind == "whole" else ctx.decode


def corrected(candidate: Candidate, state: LearnedState, now: float) -> Prediction:
    """The raw prediction rescaled by what this router measured of the route on these
    replicas (of background prefills, for one: `Candidate.learned_as`; the TTFT of long
    prompts apart: `Candidate.ttft_learned_as`), and by how late the route's oldest
    prompt there still waiting already is; its own TPOT and the streams beside it by what
    it measured of every stream on the decode replica (`corrections.STREAMS`; a background
    prefill's own TPOT by its own: `tpot_key`). Its TTFT then gains the hop between this
    router and the replica it calls (`LearnedState.hop_s`), which no step model prices. A
    remote one's link is priced at least at the tail of a transfer that just stalled on
    it, until the prefill replica's own fit has it (`LearnedState.link_tail_s`)."""
    learned_as = candidate.learned_as
    ttft = state.factor("ttft", candidate.ttft_learned_as, candidate.prefill_replica, now)
    tpot = state.factor("tpot", tpot_key(learned_as), candidate.decode_replica, now)
    streams = state.factor("tpot", STREAMS, candidate.decode_replica, now)
    if candidate.yields:  # slower, never faster, than any stream there: see corrections.py
        streams = max(streams, tpot)
    host = state.factor("tpot", STREAMS, candidate.prefill_replica, now) if candidate.host_streams else 1.0
    hop = state.hop_s(candidate.decode_replica)  # the replica the router calls
    prediction = candidate.prediction
    if state.links and candidate.kind == "remote":
        prediction = prediction.with_tail_at_least(
            state.link_tail_s(candidate.prefill_replica, candidate.decode_replica, now))
    return prediction.scaled(ttft, tpot, candidate.overdue_x, streams, host, hop)


def score(ctx: RouteContext, candidate: Candidate, prediction: Prediction, state: LearnedState = EMPTY,
          now: float = 0.0, shared: dict | None = None) -> Scored:
    """`shared`: one dict for every candidate of the request, which keeps what they read
    alike of the replica whose streams they decode beside (priced once, not per candidate)."""
    slo_ttft, slo_tpot = ctx.slo.ttft_ms / 1000.0, ctx.slo.tpot_ms / 1000.0
    route = candidate.route
    beside = streams_host(ctx, candidate)
    slo_streams, past_reach = _once(shared, ("objective", id(beside), candidate.decode_replica, candidate.num_streams > 0),
                                    lambda: _streams_objective(ctx, candidate, beside, state, now))
    ratios, weights = [prediction.ttft_s / slo_ttft], [1.0]
    own = _chance(state, "ttft", route, prediction.ttft_s, slo_ttft, now)
    if ctx.max_tokens >= 2:
        ratios.append(prediction.tpot_s / slo_tpot)
        weights.append(1.0)
        own *= _chance(state, "tpot", tpot_key(candidate.learned_as), prediction.tpot_s, slo_tpot, now)
    if candidate.kind == "whole" and ctx.whole is not None:  # a prefill replica: long prompts land there
        own *= 1.0 - burst_miss_chance(ctx.shape, ctx.whole, prediction.tpot_s, slo_tpot)
    own_loss = (1.0 - own) * (1.0 + OVERLOAD_WEIGHT * min(max(ratios[0] - 1.0, 0.0), OVERLOAD_CAP))
    at_stake = max(0, candidate.num_streams - past_reach)  # the streams this route can still cost
    joining = candidate.joining_streams if prediction.streams_tpot_s > 0.0 else 0.0
    untouched = (_once(shared, ("untouched", id(beside)), lambda: untouched_gap_s(beside, state, now))
                 if (at_stake or joining or past_reach) and beside else 0.0)
    streams_loss = 0.0
    if at_stake:  # their margin counts for those decoding there now and those expected to join
        ratio, streams_loss = beside_streams(state, prediction.streams_tpot_s, slo_streams, at_stake, now, untouched)
        ratios.append(ratio)
        weights.append(at_stake + candidate.joining_streams)
    if candidate.host_streams:
        slo_host, host_past = _host_objective(ctx, candidate, state, now)
        host_at_stake = max(0, candidate.host_streams - host_past)
        if host_at_stake:
            host = _prefill_host(ctx, candidate)
            ratio, host_loss = beside_streams(state, prediction.host_streams_tpot_s, slo_host, host_at_stake, now,
                                              untouched_gap_s(host, state, now))
            ratios.append(ratio)
            weights.append(host_at_stake)
            streams_loss += host_loss
    if past_reach and beside is not None:
        streams_loss += past_reach_loss(state, beside, past_reach, prediction.streams_tpot_s, untouched, now)
    if joining and beside is not None:
        streams_loss += joiners_loss(state, prediction.streams_tpot_s, slo_tpot, joining, untouched, now)
    meets = all(r <= 1.0 for r in ratios)
    risk = sum(w * at_risk(1.0 - r) for w, r in zip(weights, ratios, strict=True))
    if not at_stake and candidate.num_streams and candidate.joining_streams:
        risk += joiners_risk(prediction, candidate.joining_streams, slo_tpot)
    waiting_loss = 0.0
    if candidate.blocking_s > 0.0 and ctx.decode is not None and ctx.decode.arrival_ttft_objectives:
        waiting_loss = waiters_loss(candidate.blocking_s, ctx.decode.arrival_ttft_objectives)
        risk += waiters_risk(candidate.blocking_s, ctx.decode.arrival_ttft_objectives)
    if candidate.prefill_own_s > 0.0 and prediction.ttft_s > slo_ttft:  # its queue runs past the objective
        queue = _prefill_host(ctx, candidate)
        if queue is not None:
            waiting_loss += queue_waiters_loss(queue.prompt_rate, candidate.prefill_done_s, candidate.prefill_own_s,
                                               slo_ttft)
    return Scored(candidate, prediction, meets, tuple(sorted(1.0 - r for r in ratios)),
                  own_loss + streams_loss + waiting_loss, risk)


def _prefill_host(ctx: RouteContext, candidate: Candidate) -> ReplicaLoad | None:
    """A remote candidate's prefill replica, as the context priced it."""
    return next((p for p in ctx.prefills if p.replica_id == candidate.prefill_replica), None)


def _once(shared: dict | None, key: tuple, compute):
    """`compute()`, kept in `shared` under `key` for the request's other candidates."""
    if shared is None:
        return compute()
    value = shared.get(key, _MISSING)
    if value is _MISSING:
        value = shared[key] = compute()
    return value


_MISSING = object()


def _streams_objective(ctx: RouteContext, candidate: Candidate, beside: ReplicaLoad | None, state: LearnedState,
                       now: float) -> tuple[float, int]:
    """`stream_slo_s` as this candidate's corrected predictions see the streams on
    `beside` (`streams_host`): past reach
    below the gap they would see with nothing added, rescaled as the streams' TPOT is.

    Nothing added is the replica's decode step alone, not its expected gap: that one
    counts the prompts that stalled the streams lately, which are what the routes decide
    now. Held to the expected gap, a replica whose recent local prefills had stretched
    its gaps past a tight objective had every stream past reach; a 1,496-token prompt
    then cost no stream anything locally and prefilled there, and the streams after it
    decoded at 40-90 ms a token against 26 (bench cluster run AY, tight_tpot)."""
    if not candidate.num_streams or beside is None:
        return math.inf, 0
    floor = replica_steps.decode_step_s(beside) * state.factor("tpot", STREAMS, candidate.decode_replica, now)
    return stream_slo_s(ctx, floor, beside)


def _host_objective(ctx: RouteContext, candidate: Candidate, state: LearnedState,
                    now: float) -> tuple[float, int]:
    """`_streams_objective` for the streams on a remote candidate's prefill replica (the
    requests run whole there), which its prompt's chunks stall. Run whole on the prefill
    replica as the last short prompts left it, a 1,816-token request then decoded beside
    every long remote prefill sent there after it: 16 tokens in 8.7 s against a 74 ms
    objective, none of which its first prediction could see (bench cluster, load shift)."""
    host = _prefill_host(ctx, candidate)
    default = ctx.slo.tpot_ms / 1000.0
    if host is None:
        return default, 0
    floor = replica_steps.decode_step_s(host) * state.factor("tpot", STREAMS, host.replica_id, now)
    return stream_objective_s(host, default, floor)


def _chance(state: LearnedState, metric: str, key: str, predicted_s: float, objective_s: float,
            now: float) -> float:
    chance = state.chance_within(metric, key, predicted_s, objective_s, now)
    if chance is None:
        return 1.0 if predicted_s <= objective_s else 0.0
    return chance


# A request that misses its TTFT on a route costs more than itself: how far it misses is
# how far that route's queue runs past the objective, and its prompt lengthens the backlog
# every later request there waits behind. Without this, an overloaded cluster sends every
# hopeless request to the prefill pool (it slows no streams), whose queue then never
# drains: simulated (`pdcluster plan`'s simulator, `mixed` at 4 req/s on 1 prefill + 3
# decode replicas) 19% of requests met the SLO without it, 74% with it (the token
# threshold: 85%).
OVERLOAD_WEIGHT = 1.0  # per objective's worth of predicted lateness
OVERLOAD_CAP = 8.0
LOSS_RESOLUTION = 1e-3  # expected losses closer than this are equal: the risk decides


def best(scored: list[Scored]) -> Scored:
    return min(scored, key=lambda s: (round(s.loss / LOSS_RESOLUTION), s.risk, [-x for x in s.slack]))


class AutoPolicy(RoutingPolicy):
    """Predict every candidate, keep the SLO with the most slack, explore stale routes."""

    def __init__(self, state: LearnedState = EMPTY, now: float = 0.0, explore_fraction: float = 0.02,
                 stale_after_s: float = 20.0) -> None:
        self.state, self.now = state, now
        self.explore_fraction, self.stale_after_s = explore_fraction, stale_after_s

    def decide(self, ctx: RouteContext) -> RouteDecision:
        shared: dict = {}
        scored = [score(ctx, c, corrected(c, self.state, self.now), self.state, self.now, shared)
                  for c in candidates(ctx) if c.kind != "remote" or ctx.decode_has_room]
        if not scored:  # a context without replica loads: nothing to price
            return RouteDecision("local", "prefill-unhealthy" if ctx.num_healthy_prefill == 0 else "decode-busy")
        chosen = best(scored)
        probe = self._explore(ctx, scored, chosen)
        alternatives = tuple(Alternative(s.candidate, s.prediction, s.meets, s.loss) for s in scored)
        if probe is not None:
            return _decision(probe, "explore", alternatives)
        return _decision(chosen, self._reason(ctx, chosen), alternatives)

    def _reason(self, ctx: RouteContext, chosen: Scored) -> str:
        if not chosen.meets:
            return "no-route-meets-slo"
        if chosen.candidate.route == "local" and ctx.num_healthy_prefill == 0:
            return "prefill-unhealthy"
        if chosen.candidate.route == "local" and not ctx.decode_has_room and ctx.num_healthy_prefill > 0:
            return "decode-busy"
        return REASON_BY_KIND[chosen.candidate.kind]

    def _explore(self, ctx: RouteContext, scored: list[Scored], chosen: Scored) -> Scored | None:
        if not chosen.meets or not in_explore_bucket(ctx.request_id, self.explore_fraction):
            return None
        other = "local" if chosen.candidate.route == "disagg" else "disagg"
        if not self.state.stale(other, self.now, self.stale_after_s):
            return None
        alternatives = [s for s in scored if s.candidate.route == other and s.meets]
        return max(alternatives, key=lambda s: s.slack) if alternatives else None


def in_explore_bucket(request_id: str, fraction: float) -> bool:
    """A stable hash of the request id, so the same request explores on every router."""
    if not request_id:
        return False
    bucket = zlib.crc32(request_id.encode()) % EXPLORE_BUCKETS
    return bucket < fraction * EXPLORE_BUCKETS


def _decision(s: Scored, reason: str, alternatives: tuple[Alternative, ...] = ()) -> RouteDecision:
    c = s.candidate
    return RouteDecision(c.route, reason, yield_prefill=c.kind == "background", candidate=c,
                         prediction=s.prediction, alternatives=alternatives)
