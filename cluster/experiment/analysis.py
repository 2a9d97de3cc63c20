"""What an experiment found, per workload: every arm's metrics (pooled over its repeats,
with their spread), each variant against the baseline with a verdict, output agreement
on the quality set, the doctor's findings, and a recommendation."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from cluster.doctor.evidence import Evidence
from cluster.doctor.symptoms import diagnose
from cluster.experiment.quality import Agreement
from cluster.experiment.quality import compare as compare_samples
from cluster.experiment.runner import BASELINE, Experiment
from cluster.experiment.runs import RunResult
from cluster.experiment.stats import METRICS, compare, spread, value
from cluster.loadtest.config import SLO

GATES = ("goodput_fraction", "error_fraction")  # a variant worse on either is never adopted
GAINS = ("goodput_fraction", "ttft_p90_ms", "tpot_p50_ms", "e2e_p90_ms", "output_tokens_per_s")


def arms(exp: Experiment, workload: str) -> dict[str, list[RunResult]]:
    out: dict[str, list[RunResult]] = defaultdict(list)
    for r in exp.results:
        if r.key.workload == workload:
            out[r.key.variant].append(r)
    return dict(out)


def arm_summary(runs: list[RunResult], slo: SLO) -> dict[str, Any]:
    records = [r.records for r in runs]
    metrics = {m.name: {"value": value(m, records, slo), "spread": spread(m, records, slo)} for m in METRICS}
    facts = [r.facts() for r in runs]
    errors: Counter = Counter()
    routes: Counter = Counter()
    reasons: Counter = Counter()
    for f in facts:
        errors.update(f["errors"])
        routes.update(f["routes"])
        reasons.update(f["reasons"])
    return {
        "runs": len(runs), "requests": sum(f["requests"] for f in facts), "metrics": metrics,
        "errors": dict(errors), "timeouts": sum(f["timeouts"] for f in facts),
        "rejected_429": sum(f["rejected_429"] for f in facts), "disconnects": sum(f["disconnects"] for f in facts),
        "peak_kv_blocks_used": _max(f["peak_kv_blocks_used"] for f in facts),
        "preemptions": _sum(f["preemptions"] for f in facts),
        "prefix_cache_hit_rate": _mean(f["prefix_cache_hit_rate"] for f in facts),
        "routes": dict(routes), "reasons": dict(reasons),
    }


def _max(values) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _sum(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _mean(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def quality(base: list[RunResult], other: list[RunResult]) -> dict[str, Any]:
    """Every run's samples against the baseline's first run; and each check's pass rate."""
    reference = next((r.samples for r in base if r.samples), [])
    agreements: list[Agreement] = []
    for run in other:
        agreements += [compare_samples(b, o) for b, o in zip(reference, run.samples, strict=False)]
    checks: dict[str, list[bool]] = defaultdict(list)
    for run in other:
        for s in run.samples:
            for name, ok in s.checks.items():
                checks[name].append(ok)
    verdicts = Counter(a.verdict for a in agreements)
    return {
        "compared": len(agreements), "identical": verdicts.get("identical", 0),
        "near_tie": verdicts.get("near-tie", 0), "different": verdicts.get("different", 0),
        "errors": verdicts.get("error", 0),
        "agreement": verdicts.get("identical", 0) / len(agreements) if agreements else None,
        "differences": [vars(a) for a in agreements if a.verdict in ("different", "near-tie")],
        "check_pass_rate": {name: sum(v) / len(v) for name, v in checks.items() if v},
    }


def doctor_findings(runs: list[RunResult], profiles: dict[str, dict]) -> list[dict[str, Any]]:
    """Each symptom the doctor finds in any of the arm's runs, once, with its latest evidence."""
    found: dict[tuple, dict] = {}
    for run in runs:
        if not run.records:
            continue
        evidence = Evidence(window=run.window(), profiles=profiles, records=run.records, source=f"run {run.out_dir}")
        for f in diagnose(evidence):
            found[(f.symptom, f.workload)] = {**f.to_json(), "run": run.key.folder}
    return list(found.values())


def recommend(comparisons: dict[str, dict[str, dict]], quality_by: dict[str, dict]) -> dict[str, Any]:
    """Adopt the variant that gains beyond noise without losing on goodput, errors or output
    agreement; otherwise keep the baseline."""
    candidates = []
    for name, by_metric in comparisons.items():
        verdicts = {m: c["verdict"] for m, c in by_metric.items()}
        q = quality_by.get(name, {})
        blockers = [m for m in GATES if verdicts.get(m) == "worse"]
        blockers += [f"{q['different']} quality samples differ"] if q.get("different") else []
        blockers += [f"{c} check pass rate lower" for c, rate in q.get("check_pass_rate", {}).items()
                     if rate < quality_by.get(BASELINE, {}).get("check_pass_rate", {}).get(c, 0.0)]
        gains = [m for m in GAINS if verdicts.get(m) == "better"]
        losses = [m for m in GAINS if verdicts.get(m) == "worse"]
        candidates.append({"variant": name, "gains": gains, "losses": losses, "blockers": blockers,
                           "goodput_change": by_metric.get("goodput_fraction", {}).get("change")})
    eligible = [c for c in candidates if c["gains"] and not c["blockers"] and not c["losses"]]
    if not eligible:
        why = "; ".join(f"{c['variant']}: " + (", ".join(c["blockers"] + [f"worse {m}" for m in c["losses"]])
                                               or "no gain beyond noise") for c in candidates)
        return {"decision": "keep the baseline", "variant": None, "evidence": why, "candidates": candidates}
    best = max(eligible, key=lambda c: ("goodput_fraction" in c["gains"], len(c["gains"]),
                                        c["goodput_change"] or 0.0))
    return {"decision": f"adopt {best['variant']}", "variant": best["variant"],
            "evidence": f"better {', '.join(best['gains'])} beyond noise; no worse goodput, errors or outputs",
            "candidates": candidates}


def analyse(exp: Experiment) -> dict[str, Any]:
    spec, slo = exp.spec, SLO(**exp.spec.slo.model_dump())
    out: dict[str, Any] = {}
    for workload in spec.workloads:
        by_arm = arms(exp, workload.name)
        base = by_arm.get(BASELINE, [])
        summaries = {name: arm_summary(runs, slo) for name, runs in by_arm.items()}
        comparisons = {
            name: {m.name: compare(m, [r.records for r in base], [r.records for r in runs], slo,
                                   spec.bootstrap_resamples, spec.min_effect, spec.seed).to_json() for m in METRICS}
            for name, runs in by_arm.items() if name != BASELINE and base}
        quality_by = {name: quality(base, runs) for name, runs in by_arm.items()} if spec.samples else {}
        out[workload.name] = {
            "arms": summaries, "comparisons": comparisons, "quality": quality_by,
            "doctor": {name: doctor_findings(runs, exp.snapshot) for name, runs in by_arm.items()},
            "recommendation": recommend(comparisons, quality_by) if comparisons else
            {"decision": "no comparison (the baseline did not run)", "variant": None, "evidence": ""},
        }
    return out
