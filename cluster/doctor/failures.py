"""Requests that failed outright: timeouts, 429s by tenant, a prefill pool that is down."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import Finding

FAILURE_SHARE = 0.01  # timeouts or 429s: at least this share of requests (and one)


def _requests_in(ev: Evidence) -> float:
    if ev.records:
        return float(len(ev.records))
    return ev.window.counter("pdc_route_decisions") if ev.window is not None else 0.0


def _failures(ev: Evidence, counter: str, label: str, error_kinds: tuple[str, ...]) -> dict[str, float]:
    by: dict[str, float] = {}
    if ev.window is not None:
        by = ev.window.counter_by(counter, label)
    if not by and ev.records:
        for r in ev.records:
            if r.error_kind in error_kinds:
                by["(this run)"] = by.get("(this run)", 0.0) + 1
    return by


def timeouts(ev: Evidence) -> list[Finding]:
    by_tenant = _failures(ev, "pdc_request_timeouts", "tenant", ("timeout",))
    n, requests = sum(by_tenant.values()), _requests_in(ev)
    if n < 1 or n < FAILURE_SHARE * requests:
        return []
    return [Finding(
        "timeouts", "Requests are timing out",
        f"{n:.0f} requests timed out ({n / max(requests, 1):.1%}); by tenant: {_counts(by_tenant)}.",
        "Compare the workload's deadline_s with the TTFT and E2E it gets; scale out or shed load (quotas) "
        "when the deployment is saturated, or raise the deadline where it is set too tight.",
        {"timeouts": n, "requests": requests, "by_tenant": by_tenant})]


def rejections(ev: Evidence) -> list[Finding]:
    by_code: dict[str, float] = {}
    by_tenant = _failures(ev, "pdc_requests_rejected", "tenant", ("http_429",))
    if ev.window is not None:
        by_code = ev.window.counter_by("pdc_requests_rejected", "code")
    n, requests = sum(by_tenant.values()), _requests_in(ev)
    if n < 1 or n < FAILURE_SHARE * (requests + n):
        return []
    return [Finding(
        "rejections", "Requests are refused with 429",
        f"{n:.0f} requests got 429; by tenant: {_counts(by_tenant)}; by code: {_counts(by_code) or 'unknown'}.",
        "rate_limit_exceeded / concurrency_limit_exceeded: the tenant's quota in the API keys file, or a client "
        "that honours Retry-After; server_overloaded: scale out or raise admission.max_concurrent_requests / "
        "max_queued_requests.",
        {"rejected": n, "by_tenant": by_tenant, "by_code": by_code})]


def _counts(by: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def prefill_pool_down(ev: Evidence) -> list[Finding]:
    pools = (ev.health or {}).get("pools") or {}
    prefill = pools.get("prefill") or {}
    if prefill.get("status") != "down":
        return []
    return [Finding(
        "prefill-pool-down", "Prefill pool down: every request prefills locally",
        f"/health is {ev.health.get('status')!r}: prefill pool {prefill}.",
        "Look at the prefill replicas (Ray dashboard, `serve status`); requests still complete on the decode "
        "pool, with longer TTFT under load.", {"prefill": prefill})]
