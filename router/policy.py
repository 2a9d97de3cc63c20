"""Per-request routing policy: prefill on a prefill replica (`disagg`) or where the
request decodes (`local`).

The router gathers everything a policy may look at into one `RouteContext` (the prompt,
the chosen decode replica's prefix-cache hit, both pools' load and health, the workload
profile) and asks `RoutingPolicy.decide`. Policies are pure functions of that context,
so they are table-tested and a smarter `auto` (one that predicts TTFT/TPOT from the
replicas' live step times, carried in `prefill_stats` / `decode_stats`) drops in behind
the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from workers.protocol import REASONS, Route


@dataclass(frozen=True)
class ProfileView:
    """The parts of a workload profile a policy reads (decoupled from the pydantic model)."""

    mode: str = "auto"
    min_remote_prefill_tokens: int = 256
    max_prefill_queue: int = 4
    max_local_prefill_tokens_while_decoding: int = 512


@dataclass(frozen=True)
class RouteContext:
    prompt_len: int
    num_cached_tokens: int  # the chosen decode replica's expected prefix-cache hit
    profile: ProfileView
    forced_mode: str | None = None  # a client `x-pd-mode` the profile allows, else None
    num_healthy_prefill: int = 0
    prefill_queue_len: int = 0  # of the least-loaded healthy prefill replica
    decode_has_room: bool = True  # the decode replica can hold this request's KV now
    # requests the decode replica runs or is about to (its reported running + waiting, or
    # what this router has in flight there, remote prefills included): what a local
    # prefill on it would stall
    decode_num_requests: int = 0
    prefill_stats: dict[str, Any] = field(default_factory=dict)  # for future predictive policies
    decode_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def num_uncached_tokens(self) -> int:
        return max(0, self.prompt_len - self.num_cached_tokens)


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    reason: str

    def __post_init__(self) -> None:
        assert self.route in ("local", "disagg"), self.route
        assert self.reason in REASONS, self.reason


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


class AutoPolicy(RoutingPolicy):
    """Disaggregate only when it pays (Dynamo's conditional rule): a long uncached prompt
    goes to the prefill pool; a busy pool (`max_prefill_queue` reached) spills it to the
    decode replica only where that prefill would not stall streams there (Dynamo's
    decode-busy guard): the replica has nothing running or coming, or the uncached prompt
    is at most `max_local_prefill_tokens_while_decoding`. Otherwise it queues for the
    prefill pool: a 1-2k-token local prefill takes seconds, every stream beside it stalls
    once per chunk and misses its TPOT, while the queue costs only TTFT."""

    def decide(self, ctx: RouteContext) -> RouteDecision:
        if ctx.num_healthy_prefill == 0:
            return RouteDecision("local", "prefill-unhealthy")
        profile = ctx.profile
        threshold = profile.min_remote_prefill_tokens
        if ctx.num_uncached_tokens < threshold:
            reason = "prefix-hit" if ctx.prompt_len >= threshold else "short-prompt"
            return RouteDecision("local", reason)
        if ctx.prefill_queue_len >= profile.max_prefill_queue and (
                ctx.decode_num_requests == 0
                or ctx.num_uncached_tokens <= profile.max_local_prefill_tokens_while_decoding):
            return RouteDecision("local", "prefill-busy")
        if not ctx.decode_has_room:
            return RouteDecision("local", "decode-busy")
        return RouteDecision("disagg", "long-prompt")  # queued behind a busy pool, if need be


def policy_for(ctx: RouteContext) -> RoutingPolicy:
    """The policy that applies: a permitted client override first, then the profile."""
    if ctx.forced_mode is not None:
        return _POLICIES[ctx.forced_mode](reason="forced") if ctx.forced_mode != "auto" else AutoPolicy()
    mode = ctx.profile.mode
    return _POLICIES[mode](reason="profile") if mode != "auto" else AutoPolicy()


_POLICIES = {"local": LocalPolicy, "disagg": DisaggPolicy}


def decide(ctx: RouteContext) -> RouteDecision:
    return policy_for(ctx).decide(ctx)
