"""The symptoms `doctor` knows: each a pure function of the evidence that returns the
findings it supports (none on a healthy deployment). Thresholds are named constants;
every finding carries the numbers it rests on and the technique or setting that fits.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.doctor.evidence import Evidence
from cluster.loadtest.client import RequestRecord

# Prefix reuse: blocks that repeat earlier content vs blocks in a shared prefix.
PREFIX_MIN_REQUESTS, PREFIX_MIN_BLOCKS = 8, 4
PREFIX_REUSABLE_SHARE, PREFIX_SHARED_SHARE, PREFIX_HIT_RATE = 0.30, 0.10, 0.10
KV_FREE_FLOOR = 0.05  # a pool with under 5% of its blocks free cannot grow its batch
ROUTE_MIN_REQUESTS = 5  # per route, for a comparison
DISAGG_SLOWER_RATIO = 1.2  # disaggregated TTFT / local TTFT on prompts of the same lengths
DISAGG_SLOWER_RATIO_UNMATCHED = 1.5  # the same from metrics alone (prompt lengths unknown)
MISROUTED_SHARE = 0.5  # of disaggregated requests with short prompts
CROWDED_SHARE = 0.25  # of long local prefills that ran beside busy streams
BUSY_STREAMS = 2  # streams decoding beside a local prefill that it stalls
POOL_BUSY_WAITING = 1.0  # mean requests waiting in a pool
POOL_BUSY_ROUTED = 0.20  # of route decisions sent around a pool because it was busy
TRANSFER_SHARE = 0.65  # mean KV transfer time / mean disaggregated TTFT (about half is usual on one CPU node)
QUEUE_SHARE = 0.50  # mean queue time / mean TTFT
FAILURE_SHARE = 0.01  # timeouts or 429s: at least this share of requests (and one)


@dataclass
class Finding:
    symptom: str
    title: str
    evidence: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)
    workload: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Check = Callable[[Evidence], list[Finding]]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _by_workload(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.workload].append(r)
    return groups


# ---- prefix cache ------------------------------------------------------------------------


def prefix_structure(records: list[RequestRecord]) -> tuple[float, float, int]:
    """(share of prompt blocks repeating an earlier request's block at the same place,
    share of blocks inside a prefix shared with an earlier request, blocks)."""
    seen_at: set[tuple[int, str]] = set()
    seen_prefix: set[int] = set()
    reusable = shared = total = 0
    for r in sorted(records, key=lambda r: r.sent_at_s):
        hashes = r.prompt_block_hashes
        prefix_key, prefix_len, open_prefix = 0, 0, True
        for i, h in enumerate(hashes):
            prefix_key = hash((prefix_key, h))
            if open_prefix and prefix_key in seen_prefix:
                prefix_len = i + 1
            else:
                open_prefix = False
            reusable += (i, h) in seen_at
            seen_prefix.add(prefix_key)
            seen_at.add((i, h))
        shared += prefix_len
        total += len(hashes)
    if total == 0:
        return 0.0, 0.0, 0
    return reusable / total, shared / total, total


def prefix_dynamic_first(ev: Evidence) -> list[Finding]:
    hit_rate = None
    if ev.window is not None:
        queries = ev.window.counter("pdc_prefix_cache_queries")
        hit_rate = ev.window.counter("pdc_prefix_cache_hits") / queries if queries > 0 else None
    findings = []
    for workload, records in _by_workload(ev.records).items():
        if len(records) < PREFIX_MIN_REQUESTS:
            continue
        reusable, shared, blocks = prefix_structure(records)
        if blocks < PREFIX_MIN_BLOCKS * len(records) or reusable < PREFIX_REUSABLE_SHARE:
            continue
        if shared > PREFIX_SHARED_SHARE or (hit_rate is not None and hit_rate > PREFIX_HIT_RATE):
            continue
        hit = "unknown" if hit_rate is None else f"{hit_rate:.1%}"
        findings.append(Finding(
            "prefix-dynamic-first", "Prefix cache misses content the requests share", (
                f"{reusable:.0%} of {workload}'s prompt blocks repeat content an earlier request sent at the "
                f"same place, but only {shared:.0%} lie in a shared prefix; prefix-cache hit rate {hit}. "
                "The requests differ early and agree later: dynamic content is placed before the stable part."),
            "Put the stable content (system prompt, instructions, documents, tool definitions) first and the "
            "varying content (dates, ids, user data) after it; serialise it deterministically (sorted keys, "
            "fixed whitespace), so the shared part becomes a prefix the cache can reuse.",
            {"reusable_block_share": round(reusable, 4), "prefix_block_share": round(shared, 4),
             "prefix_cache_hit_rate": hit_rate, "requests": len(records)}, workload))
    return findings


# ---- KV pool --------------------------------------------------------------------------------


def kv_pressure(ev: Evidence) -> list[Finding]:
    if ev.window is None:
        return []
    preemptions = ev.window.counter("pdc_num_preemptions")
    worst: tuple[float, str] | None = None
    for pool in ("decode", "prefill"):
        free = ev.window.gauge("pdc_kv_blocks_free", pool=pool)
        total = ev.window.gauge("pdc_kv_blocks_total", pool=pool)
        shares = [f / t for f, t in zip(free, total, strict=False) if t > 0]
        if shares and (worst is None or min(shares) < worst[0]):
            worst = (min(shares), pool)
    low = worst is not None and worst[0] < KV_FREE_FLOOR
    if preemptions < 1 and not low:
        return []
    free_text = f"as few as {worst[0]:.1%} of the {worst[1]} pool's KV blocks free" if worst else "KV use unknown"
    return [Finding(
        "kv-pressure", "KV pool exhausted: the batch cannot grow",
        f"{preemptions:.0f} preemptions in the window; {free_text}.",
        "Add decode replicas (or KV memory: engine.num_kv_blocks / GPU memory share), lower the context limit "
        "(model.max_model_len, limits.max_tokens_limit), or admit fewer concurrent sequences "
        "(engine.max_num_seqs).",
        {"preemptions": preemptions, "min_free_share": None if worst is None else round(worst[0], 4),
         "pool": None if worst is None else worst[1]})]


# ---- routes ---------------------------------------------------------------------------------


def _ttfts(records: list[RequestRecord], route: str, low: int, high: int) -> list[float]:
    return [r.ttft_s for r in records if r.route == route and r.ttft_s is not None
            and r.prompt_tokens is not None and low <= r.prompt_tokens <= high]


def disagg_slower(ev: Evidence) -> list[Finding]:
    """Per workload; over the whole run when no workload took both routes (e.g. one profile
    forced to each)."""
    groups = _by_workload(ev.ok_records())
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
        ratio = _median(remote) / _median(local)
        if ratio >= DISAGG_SLOWER_RATIO:
            findings.append(_disagg_finding(workload, ratio, _median(remote), _median(local),
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
    for workload, records in _by_workload(ev.ok_records()).items():
        remote = [r for r in records if r.route == "disagg" and r.prompt_tokens is not None
                  and not (r.reason or "").startswith("slo-")]  # not `auto`'s own predictions
        limit = ev.min_remote_prefill_tokens(workload)
        short = [r for r in remote if r.prompt_tokens < limit]
        if len(short) < ROUTE_MIN_REQUESTS or len(short) < MISROUTED_SHARE * len(remote):
            continue
        findings.append(Finding(
            "short-prompts-disaggregated", "Short prompts are being disaggregated",
            f"{workload}: {len(short)} of {len(remote)} disaggregated requests had prompts under {limit} tokens "
            f"(median {_median([r.prompt_tokens for r in short]):.0f}); their transfer costs more than their "
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
    for workload, records in _by_workload(ev.ok_records()).items():
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


# ---- pools ----------------------------------------------------------------------------------


def _replicas(ev: Evidence, pool: str) -> int:
    samples = [fams.get("pdc_num_requests_running", ()) for _, fams in ev.window.gauges]
    return len({labels.get("replica") for series in samples for labels, _ in series if labels.get("pool") == pool})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _reason_shares(ev: Evidence) -> dict[str, float]:
    by_reason = ev.window.counter_by("pdc_route_decisions", "reason")
    total = sum(by_reason.values())
    return {reason: n / total for reason, n in by_reason.items()} if total else {}


def _busier(busy: dict[str, bool], routed: dict[str, float]) -> str | None:
    """The one busy pool; of two busy pools, the one routed around at least twice as often."""
    if busy["prefill"] != busy["decode"]:
        return "prefill" if busy["prefill"] else "decode"
    if busy["prefill"]:
        for pool, other in (("prefill", "decode"), ("decode", "prefill")):
            if routed[pool] >= POOL_BUSY_ROUTED and routed[pool] >= 2 * routed[other]:
                return pool
    return None


def _active_samples(series: dict[tuple[str, str], list[float]]) -> list[int]:
    """The samples in which any pool held a request: an idle start or tail of the window
    does not dilute the means."""
    length = min((len(v) for v in series.values()), default=0)
    return [i for i in range(length) if any(v[i] > 0 for v in series.values())]


def _at(values: list[float], indices: list[int]) -> list[float]:
    return [values[i] for i in indices if i < len(values)]


def pool_imbalance(ev: Evidence) -> list[Finding]:
    """A pool is busy when requests wait in it (on average over the samples in which the
    deployment held any request), or when the router keeps routing around it
    (`prefill-busy`: prompts spilled to decode replicas; `decode-busy`: no decode room)."""
    if ev.window is None or len(ev.window.gauges) < 2:
        return []
    series = {(name, p): ev.window.gauge(f"pdc_num_requests_{name}", pool=p)
              for name in ("waiting", "running") for p in ("prefill", "decode")}
    active = _active_samples(series)
    waiting = {p: _mean(_at(series["waiting", p], active)) for p in ("prefill", "decode")}
    running = {p: _mean(_at(series["running", p], active)) for p in ("prefill", "decode")}
    replicas = {p: _replicas(ev, p) for p in ("prefill", "decode")}
    shares = _reason_shares(ev)
    busy = {p: waiting[p] >= POOL_BUSY_WAITING or shares.get(f"{p}-busy", 0.0) >= POOL_BUSY_ROUTED
            for p in ("prefill", "decode")}
    numbers = {"mean_waiting": waiting, "mean_running": running, "replicas": replicas,
               "routed_around": {p: round(shares.get(f"{p}-busy", 0.0), 3) for p in ("prefill", "decode")}}
    full = _busier(busy, {p: shares.get(f"{p}-busy", 0.0) for p in ("prefill", "decode")})
    if not replicas["prefill"] or full is None:
        return []
    idle = "decode" if full == "prefill" else "prefill"
    return [Finding(
        f"{full}-saturated", f"{full.capitalize()} pool saturated while {idle} has more room",
        f"{full} pool ({replicas[full]} replicas): {waiting[full]:.1f} requests waiting on average and "
        f"{shares.get(f'{full}-busy', 0.0):.0%} of requests routed around it ({full}-busy); the {idle} pool "
        f"({replicas[idle]} replicas) ran {running[idle]:.1f} on average with {waiting[idle]:.1f} waiting.",
        f"Shift capacity to {full} (more {full} replicas or fewer {idle}); "
        + ("let `auto` prefill more locally; " if full == "prefill" else "disaggregate more prompts; ")
        + "size the P:D split with `pdcluster plan`.", numbers)]


# ---- latency shares -----------------------------------------------------------------------


def transfer_dominates(ev: Evidence) -> list[Finding]:
    if ev.window is None:
        return []
    count, total = ev.window.histogram("pdc_time_to_first_token_seconds", route="disagg")
    transfer = ev.window.mean("pdc_kv_transfer_seconds")
    if count < ROUTE_MIN_REQUESTS or transfer is None or total <= 0:
        return []
    share = transfer / (total / count)
    if share < TRANSFER_SHARE:
        return []
    return [Finding(
        "transfer-dominates-ttft", "KV transfer is a large share of time to first token",
        f"KV transfers took {transfer * 1000:.0f} ms on average, {share:.0%} of the disaggregated TTFT "
        f"({total / count * 1000:.0f} ms over {count:.0f} requests).",
        "Check the transport path (same node: shm or CUDA IPC; across nodes: direct TCP or NCCL, not the inline "
        "path), the link's bandwidth and other traffic on it; `pdcluster bench transport` measures the path. "
        "Where it cannot be fixed, prefill short and medium prompts locally (mode `auto`).",
        {"transfer_ms": round(transfer * 1000, 2), "disagg_ttft_ms": round(total / count * 1000, 2),
         "share": round(share, 3)})]


def queueing_dominates(ev: Evidence) -> list[Finding]:
    if ev.window is None:
        return []
    count, total = ev.window.histogram("pdc_time_to_first_token_seconds")
    stages = ev.window.histogram_by("pdc_request_queue_seconds", "stage")
    queue = sum(s / c for c, s in stages.values() if c > 0)
    if count < ROUTE_MIN_REQUESTS or total <= 0 or not stages:
        return []
    share = queue / (total / count)
    if share < QUEUE_SHARE:
        return []
    by_stage = {stage: round(s / c * 1000, 2) for stage, (c, s) in stages.items() if c > 0}
    return [Finding(
        "queueing-dominates-ttft", "Queueing dominates time to first token",
        f"Requests waited {queue * 1000:.0f} ms on average before work began ({by_stage} ms by stage), "
        f"{share:.0%} of the mean TTFT ({total / count * 1000:.0f} ms).",
        "Scale out: more replicas (or autoscaling_config), or more admission slots where the router queue "
        "is the wait; shed load earlier with tenant quotas.",
        {"queue_ms": round(queue * 1000, 2), "ttft_ms": round(total / count * 1000, 2), "share": round(share, 3),
         "by_stage_ms": by_stage})]


# ---- failures --------------------------------------------------------------------------------


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


CHECKS: tuple[Check, ...] = (
    prefill_pool_down, prefix_dynamic_first, kv_pressure, disagg_slower, short_prompts_disaggregated,
    long_prompts_beside_streams, pool_imbalance, transfer_dominates, queueing_dominates, timeouts, rejections,
)
SYMPTOMS = ("prefill-pool-down", "prefix-dynamic-first", "kv-pressure", "disagg-slower",
            "short-prompts-disaggregated", "long-prompts-beside-streams", "prefill-saturated", "decode-saturated",
            "transfer-dominates-ttft", "queueing-dominates-ttft", "timeouts", "rejections")


def diagnose(ev: Evidence) -> list[Finding]:
    return [finding for check in CHECKS for finding in check(ev)]
