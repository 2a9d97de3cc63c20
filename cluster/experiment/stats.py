"""Each metric of a variant against the baseline, with a stated noise rule.

The rule: resample the requests of every run with replacement (within each run, so each
repeat keeps its weight), 1000 times by default, and recompute the metric for the
variant and the baseline. The 95% interval of variant/baseline (or, for a fraction,
variant - baseline) decides: **better** or **worse** when the interval excludes no
change and the point estimate moves by at least `min_effect` (5%, or 5 points of a
fraction) in that direction; otherwise **within noise**.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.loadtest.metrics import meets_slo, run_duration

Runs = Sequence[Sequence[RequestRecord]]  # one list of records per repeat


@dataclass(frozen=True)
class Metric:
    name: str
    lower_is_better: bool
    fraction: bool  # compared by difference, not ratio
    values: Callable[[Sequence[RequestRecord], SLO], np.ndarray]  # one value per request (NaN: none)
    reduce: Callable[[np.ndarray, float], float]  # the values of a run (or a resample) -> the metric


def _per_request(get: Callable[[RequestRecord], float | None]) -> Callable[[Sequence[RequestRecord], SLO], np.ndarray]:
    def values(records: Sequence[RequestRecord], slo: SLO) -> np.ndarray:
        return np.array([np.nan if (v := get(r)) is None else float(v) for r in records], dtype=float)
    return values


def _pct(q: float) -> Callable[[np.ndarray, float], float]:
    def reduce(values: np.ndarray, duration_s: float) -> float:
        finite = values[np.isfinite(values)]
        return float(np.percentile(finite, q)) * 1000.0 if finite.size else float("nan")
    return reduce


def _fraction(values: np.ndarray, duration_s: float) -> float:
    return float(np.mean(values)) if values.size else float("nan")


def _rate(values: np.ndarray, duration_s: float) -> float:
    return float(np.nansum(values)) / duration_s if duration_s > 0 else float("nan")


def _gaps(records: Sequence[RequestRecord], slo: SLO) -> np.ndarray:
    """Each request's inter-token gaps (an object array: resampling keeps a request's gaps together)."""
    out = np.empty(len(records), dtype=object)
    for i, r in enumerate(records):
        out[i] = np.asarray(r.itl_s if r.ok else (), dtype=float)
    return out


def _pooled_pct(q: float) -> Callable[[np.ndarray, float], float]:
    def reduce(values: np.ndarray, duration_s: float) -> float:
        gaps = np.concatenate(list(values)) if values.size else np.array([])
        return float(np.percentile(gaps, q)) * 1000.0 if gaps.size else float("nan")
    return reduce


def _ttft(r): return r.ttft_s if r.ok else None
def _tpot(r): return r.tpot_s
def _e2e(r): return r.e2e_s if r.ok else None


METRICS: tuple[Metric, ...] = (
    Metric("ttft_p50_ms", True, False, _per_request(_ttft), _pct(50)),
    Metric("ttft_p90_ms", True, False, _per_request(_ttft), _pct(90)),
    Metric("ttft_p99_ms", True, False, _per_request(_ttft), _pct(99)),
    Metric("tpot_p50_ms", True, False, _per_request(_tpot), _pct(50)),
    Metric("tpot_p90_ms", True, False, _per_request(_tpot), _pct(90)),
    Metric("itl_p50_ms", True, False, _gaps, _pooled_pct(50)),
    Metric("itl_p99_ms", True, False, _gaps, _pooled_pct(99)),
    Metric("e2e_p50_ms", True, False, _per_request(_e2e), _pct(50)),
    Metric("e2e_p90_ms", True, False, _per_request(_e2e), _pct(90)),
    Metric("goodput_fraction", False, True, lambda rs, slo: np.array([float(meets_slo(r, slo)) for r in rs]), _fraction),
    Metric("error_fraction", True, True, lambda rs, slo: np.array([float(not r.ok) for r in rs]), _fraction),
    Metric("output_tokens_per_s", False, False,
           lambda rs, slo: np.array([float(r.output_tokens) if r.ok else 0.0 for r in rs]), _rate),
)


@dataclass(frozen=True)
class Comparison:
    metric: str
    baseline: float
    variant: float
    change: float  # ratio - 1, or the difference of a fraction
    low: float  # the 95% interval of `change`
    high: float
    verdict: str  # better | worse | within noise | no data

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in vars(self).items()}


def value(metric: Metric, runs: Runs, slo: SLO) -> float:
    """The metric over all runs' requests pooled (a rate: over the runs' total duration)."""
    values = np.concatenate([metric.values(run, slo) for run in runs]) if runs else np.array([])
    return metric.reduce(values, sum(run_duration(run) for run in runs))


def spread(metric: Metric, runs: Runs, slo: SLO) -> tuple[float, float]:
    """The metric's lowest and highest value over the runs taken one at a time."""
    per_run = [metric.reduce(metric.values(run, slo), run_duration(run)) for run in runs]
    finite = [v for v in per_run if np.isfinite(v)]
    return (min(finite), max(finite)) if finite else (float("nan"), float("nan"))


def _resamples(metric: Metric, runs: Runs, slo: SLO, n: int, rng: np.random.Generator) -> np.ndarray:
    per_run = [metric.values(run, slo) for run in runs if run]
    duration = sum(run_duration(run) for run in runs)
    picks = [values[rng.integers(0, values.size, size=(n, values.size))] for values in per_run]
    stacked = np.concatenate(picks, axis=1)
    return np.array([metric.reduce(row, duration) for row in stacked])


def compare(metric: Metric, base: Runs, other: Runs, slo: SLO, n: int = 1000, min_effect: float = 0.05,
            seed: int = 0) -> Comparison:
    b, v = value(metric, base, slo), value(metric, other, slo)
    if not (np.isfinite(b) and np.isfinite(v)) or (not metric.fraction and b == 0):
        return Comparison(metric.name, b, v, float("nan"), float("nan"), float("nan"), "no data")
    rng = np.random.default_rng(seed)
    rb, rv = _resamples(metric, base, slo, n, rng), _resamples(metric, other, slo, n, rng)
    with np.errstate(divide="ignore", invalid="ignore"):
        changes = rv - rb if metric.fraction else rv / rb - 1.0
    changes = changes[np.isfinite(changes)]
    change = v - b if metric.fraction else v / b - 1.0
    low, high = (float(np.percentile(changes, 2.5)), float(np.percentile(changes, 97.5))) if changes.size \
        else (float("nan"), float("nan"))
    return Comparison(metric.name, b, v, change, low, high, verdict(metric, change, low, high, min_effect))


def verdict(metric: Metric, change: float, low: float, high: float, min_effect: float) -> str:
    if not (np.isfinite(low) and np.isfinite(high)):
        return "no data"
    up = low > 0 and change >= min_effect
    down = high < 0 and change <= -min_effect
    if not (up or down):
        return "within noise"
    return "better" if up != metric.lower_is_better else "worse"
