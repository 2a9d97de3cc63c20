"""Which policy applies to a request, and the way it runs with what the router expects.

A permitted client `x-pd-mode` first, then the profile's `mode`. `auto` decides from the
predictions itself; `threshold`, `local` and `disagg` decide by their rules and the
matching candidate is priced afterwards, so every response carries a prediction for the
route it took whatever the mode (router/predict.py, corrected as `auto` corrects it).
"""

from __future__ import annotations

import dataclasses

from router import predict
from router.auto_policy import AutoPolicy, background_candidate, corrected, remote_candidates
from router.candidate import Candidate
from router.corrections import EMPTY, LearnedState
from router.policy import (
    DisaggPolicy,
    LocalPolicy,
    RouteContext,
    RouteDecision,
    RoutingPolicy,
    ThresholdPolicy,
)
from router.queue_drain import drain

_FIXED = {"local": LocalPolicy, "disagg": DisaggPolicy, "threshold": ThresholdPolicy}


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """The router-wide knobs of `auto` (RouterSettings)."""

    explore_fraction: float = 0.02
    stale_after_s: float = 20.0


def policy_for(ctx: RouteContext, state: LearnedState = EMPTY, now: float = 0.0,
               settings: PolicySettings = PolicySettings()) -> RoutingPolicy:
    mode, reason = (ctx.forced_mode, "forced") if ctx.forced_mode is not None else (ctx.profile.mode, "profile")
    if mode == "auto":
        return AutoPolicy(state, now, settings.explore_fraction, settings.stale_after_s)
    if mode == "threshold":
        return ThresholdPolicy()
    return _FIXED[mode](reason=reason)


def decide(ctx: RouteContext, state: LearnedState = EMPTY, now: float = 0.0,
           settings: PolicySettings = PolicySettings()) -> RouteDecision:
    """Where this request prefills, with the candidate it runs as and its prediction.
    Pure: a function of the context, the learned state and the clock."""
    decision = policy_for(ctx, state, now, settings).decide(ctx)
    if decision.candidate is not None:
        return decision
    candidate = _matching(decision, ctx)
    if candidate is None:
        return decision
    return dataclasses.replace(decision, candidate=candidate, prediction=corrected(candidate, state, now))


def _matching(decision: RouteDecision, ctx: RouteContext) -> Candidate | None:
    """The candidate a fixed rule's decision runs as, the only one priced: remote on the
    least-loaded prefill replica; local whole on a prefill replica where the placement
    offers one, else in the background when the rule says so (at the engine's own chunk
    size), else the foreground."""
    if ctx.decode is None:
        return None
    if ctx.whole is not None and decision.route != "disagg":  # priced on the prefill replica alone
        return predict.whole(ctx.shape, ctx.whole, ctx.whole_cached_tokens)
    d_queue = drain(ctx.decode)
    if decision.route == "disagg":
        remote = remote_candidates(ctx, d_queue, limit=1)
        return remote[0] if remote else None
    if decision.yield_prefill:
        slow = background_candidate(ctx, d_queue)
        if slow is not None:
            return dataclasses.replace(slow, chunk_tokens=None)
    return predict.local(ctx.shape, ctx.decode, ctx.num_cached_tokens, d_queue)
