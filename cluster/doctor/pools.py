"""The pools' capacity: a KV pool that cannot grow its batch, and one pool saturated while
the other has room."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import Finding, mean

KV_FREE_FLOOR = 0.05  # a pool with under 5% of its blocks free cannot grow its batch
POOL_BUSY_WAITING = 1.0  # mean requests waiting in a pool
POOL_BUSY_ROUTED = 0.20  # of route decisions sent around a pool because it was busy


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


def _replicas(ev: Evidence, pool: str) -> int:
    samples = [fams.get("pdc_num_requests_running", ()) for _, fams in ev.window.gauges]
    return len({labels.get("replica") for series in samples for labels, _ in series if labels.get("pool") == pool})


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
    waiting = {p: mean(_at(series["waiting", p], active)) for p in ("prefill", "decode")}
    running = {p: mean(_at(series["running", p], active)) for p in ("prefill", "decode")}
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
