"""The planner's search: every option at the requested rate, ranked by goodput per
replica; saturation rates; a recommendation with headroom; how sensitive it is; whether
disaggregation pays and from which rate; and, when nothing meets the SLO, how many
replicas would.

The recommendation is the best-ranked option that meets the SLO at the requested rate
while that rate is at most `HEADROOM` of its saturation rate, so a plan never lands a
cluster at the edge of its capacity. Saturation is searched for the `TOP_K` best options
that meet the SLO (every option with `rate_sweep`), the colocated one and the best
disaggregated one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.plan.evaluate import Evaluator, PlanPoint
from cluster.plan.options import PlanOption, plan_options
from cluster.plan.saturation import Saturation, saturation_rate

HEADROOM = 0.85  # the requested rate at most this share of the recommendation's saturation rate
TOP_K = 5
SENSITIVITY = 0.2  # rate and prompt length, each this much either way
PAYS_MARGIN = 1.05  # disaggregation pays where its goodput is this much above colocated's
PAYS_RATES = (0.5, 1.0, 1.5, 2.0)  # x the requested rate, and up to past the saturation rates
GOODPUT_TIE = 0.01  # goodputs this close are equal: saturation decides
GROWTH = 1.25  # replica counts tried when nothing meets: N x GROWTH^k ...
MAX_GROWTH = 8.0  # ... up to this many times N


@dataclass
class PlanReport:
    workload: str
    rate: float
    num_replicas: int
    points: list[PlanPoint]  # every option at `rate`, ranked
    saturation: dict[str, Saturation] = field(default_factory=dict)  # by option name
    recommendation: PlanPoint | None = None
    sensitivity: dict[str, PlanPoint] = field(default_factory=dict)
    disaggregation: dict = field(default_factory=dict)
    replicas_needed: dict | None = None
    why_none: str | None = None

    def saturation_of(self, option: PlanOption) -> float | None:
        s = self.saturation.get(option.name)
        return s.rate if s is not None else None


def rank_key(p: PlanPoint) -> tuple:
    ttft_p90 = p.ttft_ms.get("p90") if p.ttft_ms.get("p90") is not None else float("inf")
    return (-round(p.goodput_per_replica, 6), -p.attainment, ttft_p90)


def run_plan(evaluate: Evaluator, rate: float, num_replicas: int, rate_sweep: bool = False,
             options: Sequence[PlanOption] | None = None, log: Callable[[str], None] = lambda _: None) -> PlanReport:
    options = list(options or plan_options(num_replicas))
    log(f"simulating {len(options)} configurations at {rate:g} req/s")
    points = sorted((evaluate(o, rate) for o in options), key=rank_key)
    report = PlanReport(evaluate.workload.name, rate, num_replicas, points)
    for point in _saturation_targets(points, rate_sweep):
        log(f"saturation rate of {point.option.name}")
        report.saturation[point.option.name] = saturation_rate(evaluate, point.option, rate, known=point)
    report.recommendation, report.why_none = _recommend(report)
    anchor = report.recommendation or points[0]
    report.sensitivity = sensitivity(evaluate, anchor.option, rate)
    report.disaggregation = disaggregation_pays(evaluate, report)
    if report.recommendation is None:
        report.replicas_needed = replicas_needed(evaluate, points[0].option, rate, num_replicas, log)
    return report


def _saturation_targets(points: list[PlanPoint], everything: bool) -> list[PlanPoint]:
    if everything:
        return points
    chosen = [p for p in points if p.meets][:TOP_K]
    for first in (_first(points, lambda p: not p.option.disaggregated), _first(points, lambda p: p.option.disaggregated)):
        if first is not None and first not in chosen:
            chosen.append(first)
    return chosen


def _first(points: list[PlanPoint], keep: Callable[[PlanPoint], bool]) -> PlanPoint | None:
    return next((p for p in points if keep(p)), None)


def _recommend(report: PlanReport) -> tuple[PlanPoint | None, str | None]:
    """Among the options that meet the SLO with headroom and come within `GOODPUT_TIE` of
    the best goodput, the one with the highest saturation rate (at low load every option
    serves every request; the one that would take the most growth is the better buy)."""
    meeting = [p for p in report.points if p.meets]
    if not meeting:
        return None, "no configuration meets the SLO at this rate"
    roomy = [p for p in meeting if (sat := report.saturation_of(p.option)) is not None and report.rate <= HEADROOM * sat]
    if not roomy:
        return None, (f"configurations meet the SLO at this rate, but none with the rate at most {HEADROOM:.0%} of "
                      "its saturation rate")
    top = max(p.goodput_per_replica for p in roomy)
    close = [p for p in roomy if p.goodput_per_replica >= (1.0 - GOODPUT_TIE) * top]
    return max(close, key=lambda p: report.saturation_of(p.option)), None


def sensitivity(evaluate: Evaluator, option: PlanOption, rate: float) -> dict[str, PlanPoint]:
    """The option at the rate and the prompt length each `SENSITIVITY` either way."""
    low, high = 1.0 - SENSITIVITY, 1.0 + SENSITIVITY
    return {f"rate_x{low:g}": evaluate(option, rate * low), f"rate_x{high:g}": evaluate(option, rate * high),
            f"prompt_len_x{low:g}": evaluate(option, rate, evaluate.workload.with_prompts(low)),
            f"prompt_len_x{high:g}": evaluate(option, rate, evaluate.workload.with_prompts(high))}


def disaggregation_pays(evaluate: Evaluator, report: PlanReport) -> dict:
    """Colocated against the disaggregated option that saturates last (the best ranked
    when none has a saturation rate), at rates around the requested one and up to past
    both saturation rates."""
    colocated = _first(report.points, lambda p: not p.option.disaggregated)
    splits = [p for p in report.points if p.option.disaggregated]
    if colocated is None or not splits:
        return {"pays": None, "from_rate": None, "by_rate": [],
                "sentence": "Only one kind of configuration was planned: nothing to compare."}
    split = max(splits, key=lambda p: report.saturation_of(p.option) or 0.0)
    by_rate = []
    for r in _pays_rates(report, colocated, split):
        c = colocated if r == report.rate else evaluate(colocated.option, r)
        s = split if r == report.rate else evaluate(split.option, r)
        pays = s.goodput_rps >= PAYS_MARGIN * c.goodput_rps or (s.meets and not c.meets)
        by_rate.append({"rate": round(r, 4), "colocated_goodput_rps": c.goodput_rps, "colocated_meets": c.meets,
                        "disaggregated_goodput_rps": s.goodput_rps, "disaggregated_meets": s.meets, "pays": pays})
    from_rate = next((row["rate"] for row in by_rate if row["pays"]), None)
    pays_here = next(row["pays"] for row in by_rate if row["rate"] == round(report.rate, 4))
    return {"pays": pays_here, "from_rate": from_rate, "colocated": colocated.option.name,
            "disaggregated": split.option.name, "by_rate": by_rate,
            "colocated_saturation_rate": report.saturation_of(colocated.option),
            "disaggregated_saturation_rate": report.saturation_of(split.option),
            "sentence": _pays_sentence(report, colocated, split, pays_here, from_rate, by_rate[-1]["rate"])}


def _pays_rates(report: PlanReport, colocated: PlanPoint, split: PlanPoint) -> list[float]:
    rates = {report.rate * x for x in PAYS_RATES}
    sats = [s for s in (report.saturation_of(colocated.option), report.saturation_of(split.option)) if s]
    for sat in sats:
        rates |= {sat * 0.9, sat * 1.1}
    return sorted(rates)


def _pays_sentence(report: PlanReport, colocated: PlanPoint, split: PlanPoint, pays: bool,
                   from_rate: float | None, top: float) -> str:
    w, r = report.workload, report.rate
    if pays:
        gain = split.goodput_rps / colocated.goodput_rps - 1.0 if colocated.goodput_rps > 0 else float("inf")
        gain_text = f"{gain:+.0%} goodput" if gain != float("inf") else "goodput where colocated has none"
        since = f", from about {from_rate:.3g} req/s on" if from_rate is not None and from_rate < r else ""
        return (f"Disaggregation pays for {w} at {r:g} req/s: {split.option.name} has {gain_text} over "
                f"{colocated.option.name}{since}.")
    if from_rate is not None:
        return (f"Disaggregation does not pay for {w} at {r:g} req/s ({colocated.option.name} does as well); "
                f"it pays from about {from_rate:.3g} req/s on ({split.option.name}).")
    return (f"Disaggregation does not pay for {w} at any rate up to {top:.3g} req/s: "
            f"{colocated.option.name} does as well as or better than {split.option.name}.")


def replicas_needed(evaluate: Evaluator, best: PlanOption, rate: float, num_replicas: int,
                    log: Callable[[str], None]) -> dict:
    """The fewest replicas at which the best option's shape (and, apart, all-colocated)
    meets the SLO with headroom: at `rate / HEADROOM`."""
    out: dict = {"rate_checked": round(rate / HEADROOM, 4)}
    for label, shape in (("best", best), ("colocated", PlanOption(0, num_replicas, "local"))):
        n, found = num_replicas, None
        while n < MAX_GROWTH * num_replicas and found is None:
            n = max(n + 1, round(n * GROWTH))
            option = shape.scaled_to(n)
            log(f"{option.name} at {rate / HEADROOM:g} req/s")
            if evaluate(option, rate / HEADROOM).meets:
                found = option
        out[label] = None if found is None else {"config": found.name, "num_replicas": found.num_replicas,
                                                 "num_prefill": found.num_prefill, "num_decode": found.num_decode,
                                                 "mode": found.mode}
    return out
