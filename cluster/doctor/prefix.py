"""Prefix reuse: prompt blocks that repeat earlier content against blocks inside a shared
prefix, which tells dynamic content placed before a stable prompt from prompts that differ."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import Finding, by_workload
from cluster.loadtest.client import RequestRecord

# Prefix reuse: blocks that repeat earlier content vs blocks in a shared prefix.
PREFIX_MIN_REQUESTS, PREFIX_MIN_BLOCKS = 8, 4
PREFIX_REUSABLE_SHARE, PREFIX_SHARED_SHARE, PREFIX_HIT_RATE = 0.30, 0.10, 0.10


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
    for workload, records in by_workload(ev.records).items():
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
