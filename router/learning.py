"""What one router replica learns about its own routing: per-request policy inputs, and
the feedback of finished requests (predicted TTFT / TPOT against what it measured) into
its corrections and the prediction metrics; `GET /admin/policy` reads it back."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from cluster.config import RouterSettings, WorkloadProfile
from router.cluster_view import ClusterView
from router.corrections import ANY_REPLICA, Corrections, Outcome
from router.metrics import RouterMetrics
from router.placement import Placement, PolicyInputs
from router.routing import PolicySettings

RECENT_OUTCOMES = 8192


class PolicyLearner:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics, router_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.metrics, self.router_id, self.clock = settings, metrics, router_id, clock
        self.corrections = Corrections(settings.correction_half_life_s)
        self.policy = PolicySettings(settings.explore_fraction, settings.stale_after_s)
        self.reset_at: float | None = None
        # (route, metric, predicted as the headers said, measured) of recent requests
        self.recent: deque[tuple[str, str, float, float]] = deque(maxlen=RECENT_OUTCOMES)

    def inputs(self, request_id: str, profile: WorkloadProfile) -> PolicyInputs:
        """What the policy reads for one request beside the view."""
        slo = profile.slo or self.settings.default_slo
        return PolicyInputs(request_id, slo, self.corrections.snapshot(), self.clock(), self.policy)

    def learn(self, placement: Placement, ttft_s: float, tpot_s: float | None,
              worker_ttft_s: float | None = None, transfer_tail_s: float | None = None) -> None:
        """Observe one finished request, under the route the policy chose (even where the
        worker fell back: a failing remote path is what must show up as slow), with the
        called worker's own TTFT where it said (the rest is the hop to it) and its KV
        transfer's tail where the prefill replica said it."""
        placement.measured_ttft_s, placement.measured_tpot_s = ttft_s, tpot_s
        placement.worker_ttft_s, placement.transfer_tail_s = worker_ttft_s, transfer_tail_s
        outcome = outcome_of(placement, ttft_s, tpot_s, worker_ttft_s, transfer_tail_s)
        if outcome is None:
            return
        shown = placement.decision.prediction  # what the headers said (corrected)
        if shown is not None:
            self.metrics.observe_prediction(outcome.route, "ttft", shown.ttft_s, ttft_s)
            self.recent.append((outcome.route, "ttft", shown.ttft_s, ttft_s))
            if outcome.measured_tpot_s is not None:
                self.metrics.observe_prediction(outcome.route, "tpot", shown.tpot_s, outcome.measured_tpot_s)
                self.recent.append((outcome.route, "tpot", shown.tpot_s, outcome.measured_tpot_s))
        now = self.clock()
        self.corrections.observe(outcome, now)
        state = self.corrections.snapshot()
        for metric, replica in (("ttft", outcome.prefill_replica), ("tpot", outcome.decode_replica)):
            self.metrics.set_correction(self.router_id, replica, outcome.key, metric,
                                        state.factor(metric, outcome.key, replica, now))

    def reset(self) -> None:
        self.corrections.reset()
        self.recent.clear()
        self.metrics.correction_factor.clear()
        self.reset_at = time.time()

    def prediction_error(self) -> dict[str, dict[str, float | int]]:
        """Over the recent requests (since the last reset): per route, the median absolute
        percentage error of the TTFT and TPOT predictions the headers carried, the median
        of measured / predicted (`_bias`: above 1, the predictions were optimistic), and
        counts."""
        out: dict[str, dict[str, float | int]] = {}
        for route in sorted({r for r, *_ in self.recent}):
            for metric in ("ttft", "tpot"):
                pairs = [(p, m) for r, k, p, m in self.recent if r == route and k == metric and m > 0 and p > 0]
                if pairs:
                    block = out.setdefault(route, {})
                    block[f"{metric}_mape"] = round(statistics.median(abs(p - m) / m for p, m in pairs), 4)
                    block[f"{metric}_bias"] = round(statistics.median(m / p for p, m in pairs), 4)
                    block[f"{metric}_samples"] = len(pairs)
        return out

    def describe(self, view: ClusterView) -> dict[str, Any]:
        """Per replica: the fitted step model and transfer costs it reported, this router's
        corrections, their sample counts and update times, and the hop to it (seconds of
        the router's TTFT beyond the worker's own, smoothed; `hop_s` at the top: over all)."""
        now, wall = self.clock(), time.time()
        corrections, hops = self.corrections.by_replica(now), self.corrections.hops()
        for entries in corrections.values():  # the injected clock's times as Unix time
            for entry in entries.values():
                entry["updated_at"] = round(wall - (now - entry["updated_at"]), 3)
        replicas = {}
        for rid, info in sorted(view.replicas.items()):
            stats = info.stats
            replicas[rid] = {
                "role": info.role, "healthy": info.healthy,
                "step_model": stats.get("step_model"), "transfer_model": stats.get("transfer_model"),
                "corrections": corrections.pop(rid, {}),
                "hop_s": _rounded(hops.get(rid)),
            }
        for rid, entry in corrections.items():  # replicas that left the view since
            replicas[rid] = {"corrections": entry}
        state = self.corrections.snapshot()
        last = {route: round(wall - (now - t), 3) for route, t in state.last_seen.items()}
        stalled = {f"{p}->{d}": {"tail_s": round(tail, 4), "measured_at": round(wall - (now - at), 3)}
                   for (p, d), (tail, at) in sorted(state.links.items()) if state.link_tail_s(p, d, now) > 0}
        return {"router": self.router_id, "reset_at": self.reset_at,
                "settings": {"explore_fraction": self.policy.explore_fraction,
                             "stale_after_s": self.policy.stale_after_s,
                             "correction_half_life_s": self.settings.correction_half_life_s,
                             "transfer_cost_max_age_s": self.settings.transfer_cost_max_age_s,
                             "default_slo": self.settings.default_slo.model_dump()},
                "last_measured": last, "prediction_error": self.prediction_error(), "stalled_links": stalled,
                "hop_s": _rounded(hops.get(ANY_REPLICA)), "replicas": replicas}


def outcome_of(placement: Placement, ttft_s: float, tpot_s: float | None,
               worker_ttft_s: float | None = None, transfer_tail_s: float | None = None) -> Outcome | None:
    """The outcome to learn from, or None when the decision carried no prediction. TPOT
    only for a single stream (n sequences interleave in one response)."""
    decision = placement.decision
    candidate = decision.candidate
    if candidate is None:
        return None
    raw = candidate.prediction
    measured_tpot = tpot_s if placement.num_sequences == 1 else None
    tokens = placement.tokens_back or placement.max_tokens  # streamed back; where untracked, as many as asked
    return Outcome(decision.route, candidate.prefill_replica, candidate.decode_replica, raw.ttft_s, ttft_s,
                   raw.tpot_s if measured_tpot is not None else None, measured_tpot, raw.transfer_s,
                   candidate.learned_as, candidate.ttft_learned_as, worker_ttft_s, tpot_gaps=max(0, tokens - 1),
                   measured_transfer_s=transfer_tail_s if decision.route == "disagg" else None)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
