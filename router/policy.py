"""Per-request routing policy: prefill on a prefill replica (`disagg`) or where the
request decodes (`local`).

The router gathers everything a policy may look at into one `RouteContext` (the prompt,
the chosen decode replica's prefix-cache hit, both pools' load and health, each
candidate replica's learned step model and queue, the workload profile and its SLO)
and asks `RoutingPolicy.decide`. Policies are pure functions of that context (and, for
`auto`, of a snapshot of what the router learned and an injected clock), so they are
table-tested and a simulator runs them unchanged. The modes: `auto` (router/auto_policy.py,
predicts every candidate's TTFT and TPOT against the SLO), `threshold` (a token
threshold and a queue cap, here), `local` and `disagg`; `router/routing.py` picks the one
that applies and attaches the predictions of the way the request runs.

What a request asks beyond one plain stream is in `RequestWork` (from its
SamplingParams): n / best_of sequences decode from one prefill, prompt logprobs recompute
the whole prompt (no prefix-cache hit), and a grammar mask costs time per decode token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from cluster.config import SLO, WorkloadProfile
from router.candidate import Candidate, Prediction, RequestShape
from router.replica_load import ReplicaLoad
from workers.engine.sampling_params import SamplingParams
from workers.engine.step_cost import YIELD_STEP_FRACTION
from workers.protocol import REASONS, Route

# A guided request's decode token costs this many plain ones: the grammar helper measured
# 0.91x tokens/s with masks computed on a background thread (tiny model, CPU). The grammar
# runs wherever the request decodes, on either route, so local-vs-disagg does not depend on
# it; a predictive policy weighs a replica's decode load with it (`RequestWork.decode_cost`).
GUIDED_TOKEN_COST = 1.0 / 0.91


@dataclass(frozen=True)
class RequestWork:
    """What one request asks of the engine beyond its prompt, as routing counts it."""

    num_sequences: int = 1  # n / best_of: decode streams sharing one prefill of the prompt
    prompt_logprobs: bool = False  # the prompt is computed whole: a prefix-cache hit is not used
    guided: bool = False  # a grammar mask per decode token (GUIDED_TOKEN_COST)

    @classmethod
    def of(cls, params: SamplingParams) -> RequestWork:
        return cls(params.num_sequences, params.prompt_logprobs is not None, params.guided is not None)

    @property
    def decode_cost(self) -> float:
        """Decode work per step on the decode replica, in plain single-stream tokens."""
        return self.num_sequences * (GUIDED_TOKEN_COST if self.guided else 1.0)


PLAIN = RequestWork()


@dataclass(frozen=True)
class RouteContext:
    """Everything a policy may look at for one request, gathered by `placement.place`."""

    prompt_len: int
    num_cached_tokens: int  # the chosen decode replica's expected prefix-cache hit
    profile: WorkloadProfile  # the workload's profile (router/profiles.py); read, never changed
    forced_mode: str | None = None  # a client `x-pd-mode` the profile allows, else None
    num_healthy_prefill: int = 0
    prefill_queue_len: int = 0  # of the least-loaded healthy prefill replica
    decode_has_room: bool = True  # the decode replica can hold this request's KV now
    # Prompt tokens this router has waiting for a first token on the least-loaded prefill
    # replica / on the chosen decode replica (what a prefill there queues behind), and the
    # requests past their first token on the decode replica (the streams it decodes now).
    # A request of n sequences counts n streams (and needs room for n).
    prefill_backlog_tokens: int = 0
    decode_backlog_tokens: int = 0
    decode_num_streams: int = 0
    work: RequestWork = PLAIN  # streams, prompt logprobs, grammar (counted in the fields above)
    # What the predictions price (router/predict.py), for every mode:
    request_id: str = ""  # exploration is chosen by its hash
    max_tokens: int = 16
    slo: SLO = field(default_factory=SLO)  # the workload's objectives (its profile's, else the default)
    decode: ReplicaLoad | None = None  # the chosen decode replica (None: a context without loads)
    # healthy prefill replicas, least loaded first (at most MAX_PREFILL_CANDIDATES), with
    # each one's expected prefix-cache hit for this prompt, in tokens
    prefills: tuple[ReplicaLoad, ...] = ()
    prefill_cached_tokens: tuple[int, ...] = ()
    whole: ReplicaLoad | None = None  # a prefill replica that may run the request whole
    whole_cached_tokens: int = 0

    @property
    def num_uncached_tokens(self) -> int:
        """Prompt tokens the prefill computes: all of them when prompt logprobs are wanted
        (a cached block has KV but no logits, so the engine recomputes it)."""
        if self.work.prompt_logprobs:
            return self.prompt_len
        return max(0, self.prompt_len - self.num_cached_tokens)

    @property
    def shape(self) -> RequestShape:
        return RequestShape(self.prompt_len, self.max_tokens, self.work.num_sequences,
                            GUIDED_TOKEN_COST if self.work.guided else 1.0, self.work.prompt_logprobs)


@dataclass(frozen=True)
class Alternative:
    """One candidate as the policy judged it: its corrected prediction, whether it kept
    every objective, and the goodput it was expected to lose."""

    candidate: Candidate
    prediction: Prediction
    meets: bool
    loss: float


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    reason: str
    # prefill in the background (`SamplingParams.yield_to_decode`): a prompt spilled onto
    # a decode replica takes only the step time its streams leave
    yield_prefill: bool = False
    candidate: Candidate | None = None  # the way it runs: replicas, chunk size, raw prediction
    prediction: Prediction | None = None  # what the router expects (corrected), for the headers
    # every candidate `auto` priced, the chosen one included (empty for the fixed rules)
    alternatives: tuple[Alternative, ...] = ()

    def __post_init__(self) -> None:
        assert self.route in ("local", "disagg"), self.route
        assert self.reason in REASONS, self.reason

    @property
    def chunk_tokens(self) -> int | None:
        """A background prefill's prompt tokens per decoding step (None: the engine's own)."""
        return self.candidate.chunk_tokens if self.candidate is not None else None


class RoutingPolicy(ABC):
    """Decides local vs disaggregated prefill for one request.

    Contract: `decide` is pure and fast (no I/O, no awaiting), never raises for any
    well-formed context, returns a reason from `workers.protocol.REASONS`, and never
    returns `disagg` when `num_healthy_prefill == 0`.
    """

    @abstractmethod
    def decide(self, ctx: RouteContext) -> RouteDecision: ...


class LocalPolicy(RoutingPolicy):
    """Always prefill where the request decodes."""

    def __init__(self, reason: str = "profile") -> None:
        self.reason = reason

    def decide(self, ctx: RouteContext) -> RouteDecision:
        return RouteDecision("local", self.reason)


class DisaggPolicy(RoutingPolicy):
    """Always prefill remotely while any prefill replica is healthy."""

    def __init__(self, reason: str = "profile") -> None:
        self.reason = reason

    def decide(self, ctx: RouteContext) -> RouteDecision:
        if ctx.num_healthy_prefill == 0:
            return RouteDecision("local", "prefill-unhealthy")
        return RouteDecision("disagg", self.reason)


# While the decode replica has streams, a spilled prompt prefills in the background: each
# step gives it prompt tokens worth YIELD_STEP_FRACTION of a decode step (`step_cost`), so
# it advances (1 + f) / f times slower than alone (3x).
SPILL_SLOWDOWN_WHILE_DECODING = (1.0 + YIELD_STEP_FRACTION) / YIELD_STEP_FRACTION


class ThresholdPolicy(RoutingPolicy):
    """Disaggregate when it pays by a token threshold (Dynamo's conditional rule): a long uncached prompt goes
    to the prefill pool, unless the decode replica would give it its first token sooner.

    The prompt spills to the decode replica (`prefill-busy`) when that replica has no
    more prompt tokens waiting than the prefill replica (never into the longer queue) and
    either the prefill replica's queue has reached `max_prefill_queue` or the expected
    wait is shorter there: `slowdown * (decode backlog + prompt) < prefill backlog +
    prompt`, the slowdown being 3 while the decode replica has streams and 1 when idle.
    A spilled prompt longer than `max_local_prefill_tokens_while_decoding` prefills in the
    background (`yield_prefill`): it takes only the step time the streams leave, so they
    keep their TPOT, and an idle decode replica lends its whole core to prefill."""

    def decide(self, ctx: RouteContext) -> RouteDecision:
        if ctx.num_healthy_prefill == 0:
            return RouteDecision("local", "prefill-unhealthy")
        profile = ctx.profile
        threshold = profile.min_remote_prefill_tokens
        if ctx.num_uncached_tokens < threshold:
            reason = "prefix-hit" if ctx.prompt_len >= threshold else "short-prompt"
            return RouteDecision("local", reason)
        if _spill(ctx):
            background = ctx.num_uncached_tokens > profile.max_local_prefill_tokens_while_decoding
            return RouteDecision("local", "prefill-busy", yield_prefill=background)
        if not ctx.decode_has_room:
            return RouteDecision("local", "decode-busy")
        return RouteDecision("disagg", "long-prompt")


def _spill(ctx: RouteContext) -> bool:
    """The decode replica is expected to prefill this prompt sooner than the prefill pool."""
    remote, local = ctx.prefill_backlog_tokens, ctx.decode_backlog_tokens
    if local > remote:
        return False
    if ctx.prefill_queue_len >= ctx.profile.max_prefill_queue:
        return True
    slowdown = SPILL_SLOWDOWN_WHILE_DECODING if ctx.decode_num_streams > 0 else 1.0
    return slowdown * (local + ctx.num_uncached_tokens) < remote + ctx.num_uncached_tokens
