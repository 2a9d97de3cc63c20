"""Routes taken against what they cost: disaggregation slower than local prefill, short
prompts sent across, long prompts prefilled beside busy streams."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import ROUTE_MIN_REQUESTS, Finding, by_workload, median
from cluster.loadtest.client import RequestRecord

DISAGG_SLOWER_RATIO = 1.2  # disaggregated TTFT / local TTFT on prompts of the same lengths
DISAGG_SLOWER_RATIO_UNMATCHED = 1.5  # the same from metrics alone (prompt lengths unknown)
MISROUTED_SHARE = 0.5  # of disaggregated requests with short prompts
CROWDED_SHARE = 0.25  # of long local prefills that ran beside busy streams
BUSY_STREAMS = 2  # streams decoding beside a local prefill that it stalls


def _ttfts(records: list[RequestRecord], route: str, low: int, high: int) -> list[float]:
    return [r.ttft_s for r in records if r.route == route and r.ttft_s is not None
            and r.prompt_tokens is not None and low <= r.prompt_tokens <= high]


def disagg_slower(ev: Evidence) -> list[Finding]:
    """Per workload; over the whole run when no workload took both routes (e.g. one profile
    forced to each)."""
    groups = by_workload(ev.ok_records())
    if not any(_both_routes(records) for records in groups.values()) and _both_routes(ev.ok_records()):
        groups = {"(all workloads)": ev.ok_records()}
    findings = []
    for workload, records in groups.items():
        lengths = {route: [r.prompt_tokens for r in records if r.route == route and r.prompt_tokens]
                   for route in ("disagg", "local")}
        if min(len(v) for v in lengths.values()) < ROUTE_MIN_REQUESTS:
            continue
        low = max(min(v) for v in lengths.values())
        high = min(max(v) for v in lengths.values())
        remote, local = _ttfts(records, "disagg", low, high), _ttfts(records, "local", low, high)
        if min(len(remote), len(local)) < ROUTE_MIN_REQUESTS:
            continue
        ratio = median(remote) / median(local)
        if ratio >= DISAGG_SLOWER_RATIO:
            findings.append(_disagg_finding(workload, ratio, median(remote), median(local),
                                            f"on prompts of {low}-{high} tokens ({len(remote)} vs {len(local)})"))
    if not ev.records and ev.window is not None:
        findings += _disagg_slower_from_metrics(ev)
    return findings


def _both_routes(records: list[RequestRecord]) -> bool:
    routes = {r.route for r in records}
    return "disagg" in routes and "local" in routes


def _disagg_slower_from_metrics(ev: Evidence) -> list[Finding]:
    findings = []
    by_route = {route: ev.window.histogram_by("pdc_time_to_first_token_seconds", "workload", route=route)
                for route in ("disagg", "local")}
    for workload in sorted(set(by_route["disagg"]) & set(by_route["local"])):
        (nd, sd), (nl, sl) = by_route["disagg"][workload], by_route["local"][workload]
        if min(nd, nl) < ROUTE_MIN_REQUESTS or sl <= 0:
            continue
        ratio = (sd / nd) / (sl / nl)
        if ratio >= DISAGG_SLOWER_RATIO_UNMATCHED:
            findings.append(_disagg_finding(workload, ratio, sd / nd, sl / nl,
                                            f"(means from /metrics, {nd:.0f} vs {nl:.0f}; prompt lengths unknown)"))
    return findings


def _disagg_finding(workload: str, ratio: float, remote_s: float, local_s: float, detail: str) -> Finding:
    return Finding(
        "disagg-slower", "Disaggregation makes this workload slower at this load",
        f"{workload}: disaggregated TTFT {remote_s * 1000:.0f} ms vs local {local_s * 1000:.0f} ms "
        f"({ratio:.2f}x) {detail}.",
        f"Prefill {workload} locally: PUT /admin/workloads/{workload} with mode `local`, or `auto` to let the "
        "router choose per request; confirm with `pdcluster experiment` (baseline vs the change).",
        {"ttft_ratio": round(ratio, 3), "disagg_ttft_ms": round(remote_s * 1000, 2),
         "local_ttft_ms": round(local_s * 1000, 2)}, workload)


def short_prompts_disaggregated(ev: Evidence) -> list[Finding]:
    findings = []
    for workload, records in by_workload(ev.ok_records()).items():
        remote = [r for r in records if r.route == "disagg" and r.prompt_tokens is not None
                  and not (r.reason or "").startswith("slo-")]  # not `auto`'s own predictions
        limit = ev.min_remote_prefill_tokens(workload)
        short = [r for r in remote if r.prompt_tokens < limit]
        if len(short) < ROUTE_MIN_REQUESTS or len(short) < MISROUTED_SHARE * len(remote):
            continue
        findings.append(Finding(
            "short-prompts-disaggregated", "Short prompts are being disaggregated",
            f"{workload}: {len(short)} of {len(remote)} disaggregated requests had prompts under {limit} tokens "
            f"(median {median([r.prompt_tokens for r in short]):.0f}); their transfer costs more than their "
            "prefill saves.",
            f"Use mode `auto` for {workload}, or `threshold` with min_remote_prefill_tokens at the break-even "
            "length (PUT /admin/workloads/NAME); clients should not force `x-pd-mode: disagg`.",
            {"short": len(short), "disaggregated": len(remote), "limit_tokens": limit}, workload))
    return findings


def _streams_at(records: list[RequestRecord], t: float, me: RequestRecord) -> int:
    return sum(1 for r in records if r is not me and r.ttft_s is not None
               and r.sent_at_s + r.ttft_s <= t < r.ended_at_s)


def long_prompts_beside_streams(ev: Evidence) -> list[Finding]:
    findings = []
    for workload, records in by_workload(ev.ok_records()).items():
        limit = ev.max_local_beside_streams(workload)
        long_local = [r for r in records if r.route == "local" and (r.prompt_tokens or 0) >= limit]
        crowded = [r for r in long_local if _streams_at(ev.records, r.sent_at_s, r) >= BUSY_STREAMS]
        if len(crowded) < 3 or len(crowded) < CROWDED_SHARE * len(long_local):
            continue
        findings.append(Finding(
            "long-prompts-beside-streams", "Long prompts are prefilled beside busy streams",
            f"{workload}: {len(crowded)} prompts of at least {limit} tokens were prefilled on the decode replica "
            f"while {BUSY_STREAMS}+ other streams were decoding there; each stalls those streams' next tokens.",
            f"Disaggregate long prompts: mode `auto` or `threshold` for {workload}, or lower "
            "max_local_prefill_tokens_while_decoding so long local prefills yield to the streams.",
            {"crowded": len(crowded), "long_local": len(long_local), "limit_tokens": limit}, workload))
    return findings
