"""The experiment's outputs: report.md for people, report.json for scripts, runs.csv with
one row per run, and the plots."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

from cluster.experiment.journal import read_journal
from cluster.experiment.runner import BASELINE, Experiment, describe_plan
from cluster.experiment.stats import METRICS
from cluster.experiment.stats import __doc__ as RULE

AUDIT_EVENTS = ("snapshot", "apply", "applied", "restore", "restored", "left", "stopped", "rollback",
                "restore_failed", "drain_timeout")


def write_report(exp: Experiment, analysis: dict[str, Any], plots: bool = True) -> dict[str, Any]:
    out = exp.out_dir
    journal = read_journal(out)
    figures = []
    if plots and exp.results:
        from cluster.experiment.plots import write_plots

        figures = write_plots(exp, analysis, out)
    report = {
        "name": exp.spec.name, "url": exp.url, "stopped": exp.stopped, "spec": exp.spec.model_dump(by_alias=True),
        "plan": describe_plan(exp.spec, exp.snapshot), "noise_rule": " ".join(RULE.split()),
        "runs": [_run_row(r) for r in exp.results], "workloads": analysis,
        "audit": [row for row in journal if row["event"] in AUDIT_EVENTS], "plots": figures,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=_json_default))
    _write_csv(out / "runs.csv", report["runs"])
    (out / "report.md").write_text(markdown(report))
    return report


def _json_default(value: Any) -> Any:
    return None if isinstance(value, float) else str(value)


def _run_row(run) -> dict[str, Any]:
    from cluster.experiment.stats import value
    from cluster.loadtest.config import SLO

    facts = run.facts()
    row = {"index": run.key.index, "repeat": run.key.repeat, "workload": run.key.workload,
           "variant": run.key.variant, "folder": f"runs/{run.key.folder}",
           "started_at": time.strftime("%H:%M:%S", time.localtime(run.started_at)),
           "duration_s": round(run.ended_at - run.started_at, 2), "requests": facts["requests"],
           "errors": sum(facts["errors"].values()), "timeouts": facts["timeouts"],
           "rejected_429": facts["rejected_429"], "disconnects": facts["disconnects"],
           "peak_kv_blocks_used": facts["peak_kv_blocks_used"], "preemptions": facts["preemptions"],
           "prefix_cache_hit_rate": facts["prefix_cache_hit_rate"],
           "disagg": facts["routes"].get("disagg", 0), "local": facts["routes"].get("local", 0)}
    slo = SLO()
    for m in METRICS:
        if m.name != "goodput_fraction":
            row[m.name] = _round(value(m, [run.records], slo))
    return row


def _round(x: Any) -> Any:
    return round(x, 4) if isinstance(x, float) and math.isfinite(x) else (None if isinstance(x, float) else x)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ---- markdown --------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 1 or x == 0 else f"{x:.3f}"
    return str(x)


def _change(c: dict[str, Any], fraction: bool) -> str:
    if c["verdict"] == "no data":
        return "no data"
    if fraction:
        return (f"{c['change'] * 100:+.1f} pts [{c['low'] * 100:+.1f}, {c['high'] * 100:+.1f}] "
                f"**{c['verdict']}**")
    return f"{c['change']:+.1%} [{c['low']:+.1%}, {c['high']:+.1%}] **{c['verdict']}**"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Experiment {report['name']}", "", f"Deployment: {report['url']}", ""]
    if report["stopped"]:
        lines += [f"> **Stopped early: {report['stopped']}.** The runs below are those that finished; "
                  "every profile change was rolled back (see the audit trail).", ""]
    lines += ["## Plan", "", *[f"  - {line.strip()}" if line.startswith("  ") else f"- {line}" for line in report["plan"]], "",
              f"Noise rule: {report['noise_rule']}", ""]
    for workload, found in report["workloads"].items():
        lines += _workload_section(workload, found)
    lines += _runs_section(report["runs"]) + _audit_section(report["audit"])
    if report["plots"]:
        lines += ["## Plots", "", *[f"![{name}]({name})" for name in report["plots"]], ""]
    return "\n".join(lines) + "\n"


def _workload_section(workload: str, found: dict[str, Any]) -> list[str]:
    rec = found["recommendation"]
    names = list(found["arms"])
    variants = [n for n in names if n != BASELINE]
    lines = [f"## Workload `{workload}`", "", f"**Recommendation: {rec['decision']}.** {rec['evidence']}", "",
             "| metric | " + " | ".join(names) + " | " + " | ".join(f"{v} vs baseline" for v in variants) + " |",
             "|---" * (1 + len(names) + len(variants)) + "|"]
    for m in METRICS:
        cells = []
        for n in names:
            entry = found["arms"][n]["metrics"][m.name]
            lo, hi = entry["spread"]
            cells.append(f"{_fmt(entry['value'])} ({_fmt(lo)}-{_fmt(hi)})")
        changes = [_change(found["comparisons"][v][m.name], m.fraction) for v in variants]
        lines.append(f"| {m.name} | " + " | ".join(cells + changes) + " |")
    lines += ["", "Values pooled over the repeats (the range of the repeats taken one at a time in brackets); "
              "changes with their 95% bootstrap interval.", "",
              "| arm | requests | errors | timeouts | 429s | disconnects | peak KV blocks | preemptions | "
              "prefix hit rate | routes | reasons |", "|---" * 11 + "|"]
    for n in names:
        a = found["arms"][n]
        lines.append(f"| {n} | {a['requests']} | {_fmt(a['errors']) if a['errors'] else 0} | {a['timeouts']} | "
                     f"{a['rejected_429']} | {a['disconnects']} | {_fmt(a['peak_kv_blocks_used'], 0)} | "
                     f"{_fmt(a['preemptions'], 0)} | {_fmt(a['prefix_cache_hit_rate'], 3)} | {a['routes']} | "
                     f"{a['reasons']} |")
    lines += ["", *_quality_section(found["quality"]), *_doctor_section(found["doctor"])]
    return lines


def _quality_section(quality: dict[str, Any]) -> list[str]:
    if not quality:
        return []
    lines = ["### Output quality (greedy, fixed sample set)", "",
             "| arm | compared | identical | near-tie flips | different | errors | agreement | checks passed |",
             "|---" * 8 + "|"]
    for name, q in quality.items():
        checks = ", ".join(f"{k} {v:.0%}" for k, v in q["check_pass_rate"].items()) or "-"
        lines.append(f"| {name} | {q['compared']} | {q['identical']} | {q['near_tie']} | {q['different']} | "
                     f"{q['errors']} | {_fmt(q['agreement'], 3)} | {checks} |")
    for name, q in quality.items():
        if q["different"]:
            lines += ["", f"> **WARNING: {name} changed {q['different']} greedy output(s) beyond a near-tie.** "
                      "A routing or batching change must not change a greedy output; first differences: "
                      + "; ".join(f"{d['sample_id']} at token {d['first_difference']} (top-2 gap "
                                  f"{_fmt(d['top2_gap'], 4)})" for d in q["differences"][:5] if
                                  d["verdict"] == "different")]
    return lines + [""]


def _doctor_section(doctor: dict[str, list]) -> list[str]:
    lines = ["### Doctor", ""]
    any_found = False
    for name, findings in doctor.items():
        for f in findings:
            any_found = True
            lines.append(f"- {name}: **{f['title']}** (`{f['symptom']}`): {f['evidence']} *What fits:* {f['fix']}")
    if not any_found:
        lines.append("No symptom found in any run.")
    return lines + [""]


def _runs_section(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["## Runs, in the order they ran", "",
             "| # | repeat | workload | arm | started | s | requests | errors | TTFT p50 ms | E2E p50 ms | routes d/l |", "|---" * 11 + "|"]
    for r in runs:
        lines.append(f"| {r['index']} | {r['repeat']} | {r['workload']} | {r['variant']} | {r['started_at']} | "
                     f"{r['duration_s']} | {r['requests']} | {r['errors']} | {_fmt(r['ttft_p50_ms'])} | "
                     f"{_fmt(r['e2e_p50_ms'])} | {r['disagg']}/{r['local']} |")
    return lines + [""]


def _audit_section(audit: list[dict[str, Any]]) -> list[str]:
    lines = ["## Audit trail (every profile change)", "", "| time | event | workload | detail |", "|---|---|---|---|"]
    for row in audit:
        detail = {k: v for k, v in row.items() if k not in ("t", "event", "workload", "workloads")}
        when = time.strftime("%H:%M:%S", time.localtime(row["t"]))
        lines.append(f"| {when} | {row['event']} | {row.get('workload', '-')} | "
                     f"{json.dumps(detail, sort_keys=True)[:300]} |")
    return lines + [""]
