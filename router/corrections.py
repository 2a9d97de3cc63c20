"""What this router learned from its own predictions: per replica and route, how far the
measured TTFT and TPOT sat from what the step models predicted.

For every finished request the router calls `Corrections.observe` with the route taken,
its uncorrected prediction and what happened (router-side: arrival to first token, so
the HTTP hop before the router is not charged to the model; TPOT for requests of two or
more tokens). A correction factor (measured / predicted, smoothed on the log scale)
then rescales later predictions for that replica and route, so a slow prefill pool, a
slow network or a cold transfer path shows up in the predictions within a few requests;
a TPOT measured over only a few gaps moves it less (`tpot_weight`).
Background prefills keep factors of their own (`Candidate.learned_as`): a foreground
one's errors say little about theirs. So do long prompts' TTFT (`Candidate.ttft_learned_as`,
key `<route>:long` from `candidate.LONG_PROMPT_TOKENS` computed tokens): a short prompt's
TTFT error is mostly the steps and hops around its prefill, and rescaled by it a long
prompt's prefill looked 1.4x what it then took. A request's own TPOT, a background
prefill's aside, is corrected by what every stream on its decode replica measured
(`tpot_key`), whatever its route; the per-route TPOT factors are kept for the record
(`GET /admin/policy`). The streams decoding beside a candidate are
corrected by one more TPOT factor per replica, learned from every TPOT outcome there
whatever its route (`STREAMS`): they are the same streams whichever way the new prompt
runs, so every candidate on that replica rescales them alike. Rescaled by the candidate's
own factor instead, one background prefill's last outcome or two could make the streams
beside a short prompt look 35% faster in the background than in the foreground, where
the arithmetic prices both the same, and short prompts queued in the background lane.
Beside a background prefill, though, the streams take its own factor where that is the
larger: its chunks hold the replica for seconds while streams keep arriving, and its
streams then err as it does (scaled by the foreground prompts' factor of 0.53, the
streams beside a 1,496-token background prefill were predicted at 30 ms a token and ran
at 62-68).

A TTFT factor rescales only what the step models priced, not the KV transfer tail: the
link has its own fit, which follows a changed link within a few transfers. A factor
learned against the whole TTFT would keep rescaling after that fit caught up (a link
that recovered leaves a factor far below 1 that then makes the next long prompt look
cheap); so the tail is taken off both sides: the predicted one off the prediction, and
off the measurement the tail the prefill replica measured (`Outcome.measured_transfer_s`,
sent back on the request's stream), or the predicted one where it did not say.

That measured tail is also the link's freshest evidence. The replica's fit learns it
only at its next report, which reaches the router a second or so later; a request sent
meanwhile was priced from the link as it had been (a link slowed to 0.8 s a transfer:
the next prompt priced at 61-109 ms and sent down it, where the router's factor, capped
and smoothed on a 30 ms model part, could not carry an 800 ms tail). So a tail that
missed its prediction as the replica's fit calls a stall (`transfer_cost.stalled`)
prices that pair's link at least that slow for `LINK_REPORT_S` (`LearnedState.link_tail_s`);
by then the replica's own fit has it, and decides whether it was a change or a blip.

Nor does it rescale the hop between the router and the replica it calls: the router's
TTFT also holds its own work before the call (placement, dispatch) and the first token's
way back, which no step model prices. Each worker says how long it took from the call to
its first token (`GenerateChunk.worker_ttft_s`); the rest of the router's TTFT is that
replica's hop, smoothed per replica (and over every replica, for one not yet measured)
and added to every TTFT prediction after the factor. Folded into the factor instead, a
fixed 10-35 ms scaled with the prediction: short prompts on an idle replica came in
15-45% slower than predicted and queued ones 10-30% faster (simulated bench traces,
local TTFT error 0.164; with the hop apart, 0.126).

A factor whose last measurement is old decays toward 1 (half-life `half_life_s`): what
was true of a route a minute ago is weaker evidence than the model itself, so a route
abandoned because it was slow is tried again once the evidence has faded (and, while
both routes are predicted to meet the SLO, re-probed by exploration sooner; see
`router/auto_policy.py`).

How far off the corrected predictions still are is kept too: the last `RESIDUALS` ratios
of measured to corrected prediction, TTFT per route and TPOT per `tpot_key` (every
foreground outcome together, background prefills apart), as the factors are. From them
`LearnedState.chance_within` says how likely a prediction is to land inside an objective,
which is what `auto` weighs routes by once it has `MIN_RESIDUALS` of them (a route
predicted just inside a tight objective with a wide spread is a worse bet than one with
less slack and a narrow one), until the route goes unmeasured for a half-life. Before
that, and after, the ratio is taken as log-normal with `PRIOR_SPREAD`. Taken as exact
instead, a prediction 1% inside an objective was as good as one 50% inside: a bench run
of a few hundred requests is spent mostly before a route has its residuals, and a long
prompt prefilled in the background at a chunk that kept six streams 17% inside their
TPOT objective for 2.8 s, where arriving prompts pushed them over it (simulated bench
traces, balanced cell: 19 requests short of the threshold rule over 792; 3 with the
prior).

`snapshot()` hands the policy an immutable `LearnedState`; `decide` reads only that, so
it stays a pure function. Corrections are per router replica; `reset()` forgets them
(not the hops, which measure the path rather than correct a model).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from router.candidate import scale_ttft
from workers.engine.transfer_cost import stalled

Metric = Literal["ttft", "tpot"]
# (metric, what it is learned as, replica): TTFT by the replica that prefills, TPOT by
# where it decodes; learned as its route, a background prefill apart (`Candidate.learned_as`)
Key = tuple[str, str, str]

SMOOTHING = 0.5  # weight of the newest measurement on the log scale (the first one moves the factor half way)
# a TPOT measured over fewer gaps than this moves a factor that much less (`tpot_weight`)
FULL_WEIGHT_GAPS = 8
MAX_RATIO = 8.0  # one measurement counts as at most this ratio either way
HALF_LIFE_S = 60.0
RESIDUALS = 128  # per metric and route: the recent measured / corrected ratios kept
MIN_RESIDUALS = 16  # fewer: the route's spread is taken to be `PRIOR_SPREAD`
# sigma of log(measured / predicted) a router assumes of a route before it has its own
# residuals: a median error of about 20%, what routers measured on the CPU bench
PRIOR_SPREAD = 0.3
HOP_SMOOTHING = 0.2  # weight of the newest hop measurement
# how long a stalled transfer's measured tail prices its link: a prefill replica's
# heartbeat (0.5 s) and a router's poll (0.5 s) carry its own fit of it here within this
LINK_REPORT_S = 2.0
MAX_HOP_S = 5.0  # one hop measurement counts as at most this
ANY_REPLICA = "*"  # the hop key pooled over every replica
STREAMS = "streams"  # the TPOT key learned from every route's outcomes on a replica
BACKGROUND = "background"  # `Candidate.learned_as` of a background prefill


@dataclass(frozen=True)
class Correction:
    log_factor: float = 0.0
    num_samples: int = 0
    updated_at: float = 0.0  # the injected clock's time of the last measurement

    @property
    def factor(self) -> float:
        return math.exp(self.log_factor)

    def to_dict(self) -> dict[str, float | int]:
        return {"factor": round(self.factor, 4), "num_samples": self.num_samples, "updated_at": self.updated_at}


@dataclass(frozen=True)
class Outcome:
    """One finished request: the route it took and what was predicted / measured."""

    route: str
    prefill_replica: str
    decode_replica: str
    predicted_ttft_s: float  # uncorrected
    measured_ttft_s: float
    predicted_tpot_s: float | None = None  # None: fewer than two tokens
    measured_tpot_s: float | None = None
    predicted_transfer_s: float = 0.0  # the transfer tail inside `predicted_ttft_s`
    learned_as: str = ""  # the key of its corrections (`Candidate.learned_as`); "" = its route
    ttft_learned_as: str = ""  # the key of its TTFT correction (`Candidate.ttft_learned_as`); "" = `key`
    worker_ttft_s: float | None = None  # the called worker's own TTFT (`GenerateChunk.worker_ttft_s`)
    tpot_gaps: int = 0  # the gaps between tokens its TPOT is the mean of (0: unknown, taken as many)
    measured_transfer_s: float | None = None  # the KV transfer's tail the prefill replica measured (disagg)

    @property
    def key(self) -> str:
        return self.learned_as or self.route

    @property
    def ttft_key(self) -> str:
        return self.ttft_learned_as or self.key

    @property
    def hop_s(self) -> float | None:
        """The router's TTFT beyond the worker's own; None where the worker did not say."""
        if self.worker_ttft_s is None or not math.isfinite(self.worker_ttft_s):
            return None
        return min(max(self.measured_ttft_s - self.worker_ttft_s, 0.0), MAX_HOP_S)


@dataclass(frozen=True)
class LearnedState:
    """An immutable view of the corrections, for `decide`."""

    corrections: Mapping[Key, Correction] = field(default_factory=dict)
    last_seen: Mapping[str, float] = field(default_factory=dict)  # route -> last measurement time
    half_life_s: float = HALF_LIFE_S
    # (metric, route; for TPOT its `tpot_key`) -> the recent measured / corrected ratios, ascending
    residuals: Mapping[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)
    # `residuals`' keys -> when their last ratio came in
    residuals_seen: Mapping[tuple[str, str], float] = field(default_factory=dict)
    prior_spread: float = 0.0  # `PRIOR_SPREAD` of a router's state; 0: predictions taken as exact until measured
    hops: Mapping[str, float] = field(default_factory=dict)  # replica (or `ANY_REPLICA`) -> smoothed hop
    # (prefill replica, decode replica) -> (the tail of its last stalled transfer, when measured)
    links: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def link_tail_s(self, prefill_replica: str, decode_replica: str, now: float) -> float:
        """The tail of the pair's last transfer, where it stalled within `LINK_REPORT_S`;
        else 0 (the prefill replica's reported fit prices the link alone)."""
        seen = self.links.get((prefill_replica, decode_replica))
        if seen is None or now - seen[1] > LINK_REPORT_S:
            return 0.0
        return seen[0]

    def hop_s(self, replica: str) -> float:
        """The hop expected between the router and `replica`: its own, else every
        replica's, else nothing."""
        hop = self.hops.get(replica)
        return hop if hop is not None else self.hops.get(ANY_REPLICA, 0.0)

    def factor(self, metric: Metric, route: str, replica: str, now: float) -> float:
        c = self.corrections.get((metric, route, replica))
        if c is None:
            return 1.0
        age = max(0.0, now - c.updated_at)
        return math.exp(c.log_factor * 0.5 ** (age / self.half_life_s))

    def chance_within(self, metric: Metric, key: str, predicted_s: float, objective_s: float,
                      now: float) -> float | None:
        """The share of recent outcomes of this metric and key (TTFT: the route; TPOT: the
        `tpot_key`) that, scaled to `predicted_s`, stay within `objective_s`. With fewer
        than `MIN_RESIDUALS`, or when the key was last measured a half-life ago (its
        spread fades with its corrections: a route abandoned while it misbehaved is judged
        by the model again), the chance under `prior_spread`; None without one (the
        prediction taken as exact)."""
        ratios = self.residuals.get((metric, key))
        seen = self.residuals_seen.get((metric, key), -math.inf)
        if ratios is None or len(ratios) < MIN_RESIDUALS or now - seen > self.half_life_s:
            return _prior_chance(predicted_s, objective_s, self.prior_spread) if self.prior_spread > 0 else None
        if predicted_s <= 0:
            return 1.0
        return bisect.bisect_right(ratios, objective_s / predicted_s) / len(ratios)

    def stale(self, route: str, now: float, stale_after_s: float) -> bool:
        """No request of this route was measured for `stale_after_s`."""
        return now - self.last_seen.get(route, -math.inf) > stale_after_s


EMPTY = LearnedState()


def _prior_chance(predicted_s: float, objective_s: float, spread: float) -> float:
    """P(measured <= objective) where log(measured / predicted) ~ N(0, spread^2)."""
    if predicted_s <= 0:
        return 1.0
    if objective_s <= 0:
        return 0.0
    z = math.log(objective_s / predicted_s) / spread
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


class Corrections:
    """Mutable: observed from finished requests, read through `snapshot()`."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, prior_spread: float = PRIOR_SPREAD) -> None:
        self.half_life_s = half_life_s
        self.prior_spread = prior_spread
        self._corrections: dict[Key, Correction] = {}
        self._last_seen: dict[str, float] = {}
        self._residuals: dict[tuple[str, str], deque[float]] = {}
        self._residuals_seen: dict[tuple[str, str], float] = {}
        self._hops: dict[str, float] = {}
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        self._snapshot: LearnedState | None = None

    def observe(self, outcome: Outcome, now: float) -> None:
        state = self.snapshot()  # the residual is against the prediction as corrected before this outcome
        tail = min(max(outcome.predicted_transfer_s, 0.0), outcome.predicted_ttft_s)
        expected_hop = state.hop_s(outcome.decode_replica)
        self._residual(("ttft", outcome.route), outcome.ttft_key, outcome.prefill_replica, outcome.predicted_ttft_s,
                       outcome.measured_ttft_s, state, now, tail, expected_hop)
        own_tpot = tpot_key(outcome.key)
        self._residual(("tpot", own_tpot), own_tpot, outcome.decode_replica, outcome.predicted_tpot_s,
                       outcome.measured_tpot_s, state, now)
        hop = outcome.hop_s
        measured_tail = tail if outcome.measured_transfer_s is None else outcome.measured_transfer_s
        self._update(("ttft", outcome.ttft_key, outcome.prefill_replica), outcome.predicted_ttft_s - tail,
                     outcome.measured_ttft_s - measured_tail - (expected_hop if hop is None else hop), now)
        if outcome.measured_transfer_s is not None:
            self._link(outcome, tail, outcome.measured_transfer_s, now)
        if hop is not None:
            self._hop(outcome.decode_replica, hop)
        if outcome.predicted_tpot_s is not None and outcome.measured_tpot_s is not None:
            weight = tpot_weight(outcome.tpot_gaps)
            for key in (outcome.key, STREAMS):
                self._update(("tpot", key, outcome.decode_replica), outcome.predicted_tpot_s,
                             outcome.measured_tpot_s, now, weight)
        self._last_seen[outcome.route] = now
        self._snapshot = None

    def _residual(self, spread: tuple[Metric, str], key: str, replica: str, predicted: float | None,
                  measured: float | None, state: LearnedState, now: float, tail: float = 0.0,
                  hop: float = 0.0) -> None:
        """Measured over the corrected prediction (corrected under `key`, plus the `hop`
        expected), kept under `spread` (the spread `auto` weighs candidates by)."""
        if predicted is None or measured is None or not _usable(predicted, measured):
            return
        metric = spread[0]
        shown = scale_ttft(predicted, tail, state.factor(metric, key, replica, now)) + hop
        self._residuals.setdefault(spread, deque(maxlen=RESIDUALS)).append(measured / shown)
        self._residuals_seen[spread] = now

    def _link(self, outcome: Outcome, predicted: float, measured: float, now: float) -> None:
        """Keep a stalled transfer's tail for its pair; an ordinary one ends the last."""
        pair = (outcome.prefill_replica, outcome.decode_replica)
        if stalled(predicted, measured):
            self._links[pair] = (measured, now)
        else:
            self._links.pop(pair, None)

    def _hop(self, replica: str, hop: float) -> None:
        for key in (replica, ANY_REPLICA):
            old = self._hops.get(key)
            self._hops[key] = hop if old is None else old + HOP_SMOOTHING * (hop - old)

    def _update(self, key: Key, predicted: float, measured: float, now: float, weight: float = SMOOTHING) -> None:
        if not _usable(predicted, measured):
            return
        ratio = min(max(measured / predicted, 1.0 / MAX_RATIO), MAX_RATIO)
        old = self._corrections.get(key, Correction())
        log_factor = (1.0 - weight) * old.log_factor + weight * math.log(ratio)
        self._corrections[key] = Correction(log_factor, old.num_samples + 1, now)

    def snapshot(self) -> LearnedState:
        if self._snapshot is None:
            residuals = {key: tuple(sorted(r)) for key, r in self._residuals.items()}
            self._snapshot = LearnedState(MappingProxyType(dict(self._corrections)),
                                          MappingProxyType(dict(self._last_seen)), self.half_life_s,
                                          MappingProxyType(residuals), MappingProxyType(dict(self._residuals_seen)),
                                          self.prior_spread, MappingProxyType(dict(self._hops)),
                                          MappingProxyType(dict(self._links)))
        return self._snapshot

    def reset(self) -> None:
        self._corrections.clear()
        self._last_seen.clear()
        self._residuals.clear()
        self._residuals_seen.clear()
        self._links.clear()
        self._snapshot = None  # the hops stay: they measure the path, not the models, and every request re-measures them

    def hops(self) -> dict[str, float]:
        """{replica: smoothed hop seconds}, `ANY_REPLICA` pooled over all."""
        return dict(self._hops)

    def by_replica(self, now: float) -> dict[str, dict[str, dict]]:
        """{replica: {"ttft/disagg": {factor, effective, num_samples, updated_at}, ...}}."""
        state = self.snapshot()
        out: dict[str, dict[str, dict]] = {}
        for (metric, route, replica), c in sorted(self._corrections.items()):
            entry = dict(c.to_dict(), effective=round(state.factor(metric, route, replica, now), 4))
            out.setdefault(replica, {})[f"{metric}/{route}"] = entry
        return out


def tpot_weight(gaps: int) -> float:
    """How far one TPOT measurement moves a factor: `SMOOTHING` for a mean over
    `FULL_WEIGHT_GAPS` gaps or more (or an unknown number), in proportion below that. A
    single gap is one step's wait, whatever else that step did: the load tester's
    two-token probe, decoding alone on an idle replica in 13 ms against 36 predicted (the
    replica's recent gaps), moved the streams' factor to 0.6 before the first request of
    the run, whose streams were then predicted at 22-25 ms a token and ran at 57-62
    (bench cluster, tight cell, objective 56)."""
    if gaps <= 0:
        return SMOOTHING
    return SMOOTHING * min(1.0, gaps / FULL_WEIGHT_GAPS)


def tpot_key(learned_as: str) -> str:
    """The key a request's own TPOT is corrected under: its decode replica's streams
    (`STREAMS`, every route's outcomes there), a background prefill apart. Whichever
    way its prompt was computed, a request decodes as one more stream there; corrected
    by its route's own factor, the route whose last outcomes came in while long local
    prefills stalled the replica looked 2-3x slower to decode there than the other
    route, whose outcomes had not come in yet, and the prefills that stalled it won."""
    return learned_as if learned_as == BACKGROUND else STREAMS


def _usable(predicted: float, measured: float) -> bool:
    return predicted > 0 and measured > 0 and math.isfinite(predicted) and math.isfinite(measured)
