"""The cluster benchmark's two scenarios (run whenever `mixed` is), sized to the machine,
and what is read from their requests. Each runs once in every configuration (`auto`
with the balanced SLOs) and is scored against the balanced SLOs.

- `disagg_hurts`: long prompts at a steady pace beside a few short streams for
  `span_s` (90 s) with half of the long prompts before and half after a fault that delays
  every KV layer the prefill replica sends (`faults.kv_layer_delay_s`, test-only), from
  the middle of the run to its end. The delay adds `FAULT_TAIL_X` times the unloaded
  long-prompt TTFT to every transfer's exposed tail, so that disaggregation really hurts:
  a long prompt sent remote misses its TTFT objective (5x the unloaded TTFT) even on an
  idle link, a short one by far, and in `disagg` the transfer channel (one thread per
  peer, every transfer in turn) saturates, as a degraded link would. `auto` should notice
  and keep prompts off the slow path: the share of long prompts it sends remote in the
  `WINDOW_S` after the fault against the share before.
- `load_shift`: `half_s` of short prompts at low load (about one stream in flight, as
  `short_low_load`), then `half_s` of long prompts at high load (as `long_high_load`),
  arrivals evenly spaced so the halves do not overlap; each half scored on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.bench.sizing import LONG_LOAD, LONG_PROMPT, SHORT_PROMPT, Baseline, class_slo
from cluster.bench.slo_cells import MIN_BEST_GOOD, compare, num_good
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.local.traffic import ClusterWorkload, RequestClass, request_class

SCENARIO_NAMES = ("disagg_hurts", "load_shift")
FAULT_TAIL_X = 4.5  # the fault's added transfer tail, in unloaded long-prompt TTFTs (objective: 5x)
WINDOW_S = 30.0  # after the fault, how long `auto` has to move long prompts off the slow path
SHORT_STREAMS = 0.5  # disagg_hurts: short streams in flight on average
LONG_SPACING_X = 1.5  # disagg_hurts: long prompts at least this many unloaded TTFTs apart
HALVES = ("first_half", "second_half")
# ratio key -> (op, limit)
TARGETS = {"auto_goodput_vs_best_disagg_hurts": (">=", 0.95),
           "disagg_hurts_long_remote_share_after_vs_before": ("<=", 0.5),
           **{f"auto_goodput_vs_best_load_shift_{half}": (">=", 0.95) for half in HALVES}}


def disagg_hurts(b: Baseline, span_s: float = 90.0, num_long: int = 30) -> ClusterWorkload:
    long_s, stream_s = b.ttft_long_ms / 1000.0, b.e2e_ms(32) / 1000.0
    interval_s = max(span_s / num_long, LONG_SPACING_X * long_s)  # a slow machine: longer, never denser
    short_rate = SHORT_STREAMS / stream_s
    return ClusterWorkload(
        "disagg_hurts", f"long prompts every {interval_s:.1f} s beside short streams; from the middle on "
                        "every KV layer sent is delayed (disaggregation hurts)",
        (RequestClass("short", SHORT_PROMPT, 32, num_requests=max(1, round(short_rate * interval_s * num_long)),
                      rate=short_rate, slo=class_slo(b, "short")),
         RequestClass("long", LONG_PROMPT, 8, num_requests=num_long, interval_s=interval_s,
                      start_s=interval_s / 2, slo=class_slo(b, "long"))))


def fault_delay_s(b: Baseline, num_layers: int) -> float:
    """Per KV layer: the transfer tail the fault adds, spread over the model's layers
    (every layer of a transfer goes out once, after its prompt's last chunk)."""
    return round(FAULT_TAIL_X * b.ttft_long_ms / 1000.0 / num_layers, 4)


def fault_at_s(workload: ClusterWorkload) -> float:
    """Halfway between the middle two long prompts of the trace."""
    longs = sorted(r["timestamp"] for r in workload.rows() if request_class(r["id"]) == "long")
    k = len(longs) // 2
    return (longs[k - 1] + longs[k]) / 2.0 if k else 0.0


def load_shift(b: Baseline, half_s: float = 20.0) -> ClusterWorkload:
    short_interval_s = b.e2e_ms(32) / 1000.0  # one stream in flight
    long_interval_s = b.ttft_long_ms / 1000.0 / (2 * LONG_LOAD)  # 110% of one replica's prefill
    return ClusterWorkload(
        "load_shift", f"{half_s:g} s of short prompts at low load, then {half_s:g} s of long prompts at high load",
        (RequestClass("short", SHORT_PROMPT, 32, num_requests=max(1, int(half_s / short_interval_s)),
                      interval_s=short_interval_s, slo=class_slo(b, "short")),
         RequestClass("long", LONG_PROMPT, 16, num_requests=max(1, int(half_s / long_interval_s)),
                      interval_s=long_interval_s, start_s=half_s, slo=class_slo(b, "long"))))


def shift_at_s(workload: ClusterWorkload) -> float:
    """Where the second half starts: the long prompts' first arrival."""
    return next(c.start_s for c in workload.classes if c.name == "long")


def halves(records: Sequence[RequestRecord], at_s: float) -> dict[str, list[RequestRecord]]:
    """Records by scheduled arrival: before `at_s`, and from it on."""
    return {HALVES[0]: [r for r in records if _arrival(r) < at_s],
            HALVES[1]: [r for r in records if _arrival(r) >= at_s]}


def _arrival(r: RequestRecord) -> float:
    return r.scheduled_at_s if r.scheduled_at_s is not None else r.sent_at_s


def remote_share(records: Sequence[RequestRecord], start_s: float, end_s: float) -> tuple[float | None, int]:
    """Of the long prompts sent in [start_s, end_s) that got a route, the share sent
    remote (`disagg`), and how many there were."""
    longs = [r for r in records if request_class(r.request_id) == "long" and r.route
             and start_s <= r.sent_at_s < end_s]
    share = sum(r.route == "disagg" for r in longs) / len(longs) if longs else None
    return share, len(longs)


def remote_shift(records: Sequence[RequestRecord], fault_s: float) -> dict:
    """The long prompts' remote share before the fault and in the `WINDOW_S` after it."""
    before, num_before = remote_share(records, float("-inf"), fault_s)
    after, num_after = remote_share(records, fault_s, fault_s + WINDOW_S)
    ratio = round(after / before, 4) if after is not None and before else None
    return {"before": before, "after": after, "num_before": num_before, "num_after": num_after,
            "after_vs_before": ratio}


# ---- scoring (each request against its class's balanced SLO) ---------------------------


def score_disagg_hurts(records: dict[str, Sequence[RequestRecord]], slos: dict[str, SLO],
                       fault_s: float | None) -> dict:
    """`records[config]`: the run's requests; `fault_s`: when the fault went on in the
    `auto` run (its load test's clock)."""
    block = _compare(records, slos)
    block["long_remote_share"] = remote_shift(records["auto"], fault_s) if fault_s is not None else None
    return block


def score_load_shift(records: dict[str, Sequence[RequestRecord]], slos: dict[str, SLO], at_s: float) -> dict:
    split = {config: halves(rs, at_s) for config, rs in records.items()}
    return {half: _compare({config: parts[half] for config, parts in split.items()}, slos) for half in HALVES}


def _compare(records: dict[str, Sequence[RequestRecord]], slos: dict[str, SLO]) -> dict:
    block = compare({c: num_good(rs, slos) for c, rs in records.items()}, {c: len(rs) for c, rs in records.items()})
    block["enough"] = block["best_good"] >= MIN_BEST_GOOD  # else the ratio's target says nothing
    return block


def scenario_ratios(scored: dict[str, dict]) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {}
    if "disagg_hurts" in scored:
        hurts = scored["disagg_hurts"]
        ratios["auto_goodput_vs_best_disagg_hurts"] = hurts["ratio"]
        ratios["disagg_hurts_long_remote_share_after_vs_before"] = (hurts["long_remote_share"] or {}).get(
            "after_vs_before")
    if "load_shift" in scored:
        for half in HALVES:
            ratios[f"auto_goodput_vs_best_load_shift_{half}"] = scored["load_shift"][half]["ratio"]
    return ratios


def scenario_targets(scored: dict[str, dict], ratios: dict) -> dict[str, dict]:
    """Each scenario target whose ratio exists; `met` None where the value is missing or
    the best fixed configuration had too few good requests to judge a ratio."""
    blocks = {"auto_goodput_vs_best_disagg_hurts": scored.get("disagg_hurts"),
              **{f"auto_goodput_vs_best_load_shift_{h}": scored.get("load_shift", {}).get(h) for h in HALVES}}
    out = {}
    for key, (op, limit) in TARGETS.items():
        if key not in ratios:
            continue
        value, block = ratios[key], blocks.get(key)
        met = None if value is None or (block is not None and not block["enough"]) else (
            value >= limit if op == ">=" else value <= limit)
        out[key] = {"target": f"{op} {limit:g}", "value": value, "met": met}
    return out
