"""Where the time to first token goes: the KV transfer, or waiting for a slot."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import ROUTE_MIN_REQUESTS, Finding

TRANSFER_SHARE = 0.65  # mean KV transfer time / mean disaggregated TTFT (about half is usual on one CPU node)
QUEUE_SHARE = 0.50  # mean queue time / mean TTFT


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
