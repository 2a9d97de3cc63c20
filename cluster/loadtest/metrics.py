"""From request records to the INTERFACES.md summary: latency percentiles, throughput,
goodput (DistServe: requests per second that meet every SLO), errors, routes and the
router's prediction error per route."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.loadtest.predictions import prediction_error

PERCENTILES = (50, 90, 95, 99)
SUMMARY_KEYS = ("requests", "duration_s", "rate", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
                "throughput", "goodput", "routes", "errors", "prediction_error", "env")


@dataclass
class Summary:
    """One run's results; `to_dict()` is exactly the summary.json shape."""

    requests: dict
    duration_s: float
    rate: dict
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2e_ms: dict
    throughput: dict
    goodput: dict
    routes: dict
    errors: dict
    prediction_error: dict = field(default_factory=dict)  # absent from runs before it existed
    env: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Summary:
        return cls(**{k: data[k] for k in SUMMARY_KEYS if k in data})


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def latency_block(values_s: Sequence[float]) -> dict:
    """mean, p50, p90, p95, p99, max in milliseconds; all None when there are no values."""
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "max"]
    if not values_s:
        return dict.fromkeys(keys)
    ms = sorted(v * 1000.0 for v in values_s)
    block = {"mean": sum(ms) / len(ms)}
    block.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    block["max"] = ms[-1]
    return {k: round(v, 4) for k, v in block.items()}


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Completed and within every objective given. TPOT is undefined for a one-token
    answer, which then meets any TPOT objective."""
    if not record.ok:
        return False
    checks = ((slo.ttft_ms, record.ttft_s), (slo.tpot_ms, record.tpot_s), (slo.e2e_ms, record.e2e_s))
    return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def achieved_rate(records: Sequence[RequestRecord]) -> float:
    """Requests started per second over the span of send times: (N - 1) / span."""
    sent = sorted(r.sent_at_s for r in records)
    if len(sent) < 2 or sent[-1] <= sent[0]:
        return 0.0
    return (len(sent) - 1) / (sent[-1] - sent[0])


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the run's time 0 to the last request's end (the drain included)."""
    return max((r.ended_at_s for r in records), default=0.0)


def summarize(records: Sequence[RequestRecord], slo: SLO, target_rate: float | None, env: dict) -> Summary:
    done = [r for r in records if r.ok]
    duration = run_duration(records)
    per_s = (lambda x: round(x / duration, 4)) if duration > 0 else (lambda x: 0.0)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.target_prompt_len for r in done)
    good = sum(meets_slo(r, slo) for r in records)
    routes = Counter({"disagg": 0, "local": 0})
    routes.update(r.route for r in records if r.route)
    return Summary(
        requests={"completed": len(done), "failed": len(records) - len(done)},
        duration_s=round(duration, 4),
        rate={"target": target_rate, "achieved": round(achieved_rate(records), 4)},
        ttft_ms=latency_block([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=latency_block([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=latency_block([gap for r in done for gap in r.itl_s]),
        e2e_ms=latency_block([r.e2e_s for r in done if r.e2e_s is not None]),
        throughput={
            "requests_per_s": per_s(len(done)),
            "output_tokens_per_s": per_s(output_tokens),
            "total_tokens_per_s": per_s(output_tokens + prompt_tokens),
        },
        goodput={
            "requests_per_s": per_s(good),
            "fraction": round(good / len(records), 6) if records else 0.0,
            "slo": slo.as_dict(),
        },
        routes=dict(routes),
        errors=dict(Counter(r.error_kind for r in records if not r.ok)),
        # Without streaming the client's TTFT is its E2E and its TPOT 0: nothing to compare.
        prediction_error=prediction_error(records) if env.get("stream", True) else {},
        env=env,
    )


def schedule_lag_ms(records: Sequence[RequestRecord]) -> dict | None:
    """How late requests left against their scheduled time (open loop only)."""
    lags = [r.sent_at_s - r.scheduled_at_s for r in records if r.scheduled_at_s is not None]
    return latency_block(lags) if lags else None
