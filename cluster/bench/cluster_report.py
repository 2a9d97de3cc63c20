"""From the cluster benchmark's runs to its JSON: medians per configuration, the SLO
cells, the scenarios, the router's prediction error, every ratio and target."""

from __future__ import annotations

import statistics

from cluster.bench.cluster_scenarios import (
    scenario_ratios,
    scenario_targets,
    score_disagg_hurts,
    score_load_shift,
    shift_at_s,
)
from cluster.bench.repeat_spread import spread_by_config
from cluster.bench.route_split import describe
from cluster.bench.slo_cells import (
    BALANCED,
    CELLS,
    cell_ratios,
    cell_slos,
    cell_targets,
    score_cells,
)

# ratio key -> (op, limit); a target is listed when its ratio is
TARGETS = {"disagg_itl_p99_vs_colocated": ("<=", 0.5), "auto_ttft_p50_vs_colocated_short_low_load": ("<=", 1.05),
           "auto_goodput_vs_best_short_low_load": (">=", 0.95), "auto_goodput_vs_best_long_high_load": (">=", 0.95),
           "auto_goodput_vs_best_mixed": (">=", 0.95), "router_overhead_ttft_p50_ms": ("<=", 5.0),
           "auto_goodput_vs_colocated_mixed_balanced": (">=", 1.09),
           "auto_goodput_vs_disagg_mixed_balanced": (">=", 1.29)}
PREDICTION_TARGETS = {"ttft": 0.15, "tpot": 0.10}  # median absolute percentage error, per route


def build_report(baseline, workloads: dict, runs: dict, scenarios: dict, overhead: dict | None) -> dict:
    """`runs[workload][config]`: RunResults per repeat (cluster_runs.run_workloads);
    `scenarios`: cluster_runs.run_scenarios' answer (empty when `mixed` did not run)."""
    results = {name: {config: medians([r.figures for r in rs]) for config, rs in by_config.items()}
               for name, by_config in runs.items()}
    cells = {name: score_cells(baseline, [c.name for c in workloads[name].classes],
                               {config: [r.records for r in rs] for config, rs in by_config.items()})
             for name, by_config in runs.items()}
    scored = score_scenarios(baseline, scenarios)
    prediction = prediction_block(runs, scenarios)
    ratios = legacy_ratios(results, overhead)
    ratios.update(spread_ratios(prediction["repeat_spread"]))
    for name, by_cell in cells.items():
        ratios.update(cell_ratios(name, by_cell))
    ratios.update(scenario_ratios(scored))
    ratios.update(prediction_ratios(prediction["router_side"]))
    targets = {k: {"target": f"{op} {v:g}", "value": ratios.get(k), "met": _met(ratios.get(k), op, v)}
               for k, (op, v) in {**TARGETS, **_prediction_limits(ratios)}.items() if k in ratios}
    for name, by_cell in cells.items():
        targets.update(cell_targets(name, by_cell))
    targets.update(scenario_targets(scored, ratios))
    return {"results": results, "cells": cells, "scenarios": _scenario_output(scenarios, scored),
            "prediction": prediction, "ratios": ratios, "targets": targets}


def medians(repeats: list[dict]) -> dict:
    keys = [k for k, v in repeats[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: _median([r.get(k) for r in repeats]) for k in keys}
    out["routes"] = _sum_dicts(r["routes"] for r in repeats)
    out["cpu_s"] = {k: _median([r["cpu_s"].get(k) for r in repeats]) for k in repeats[0]["cpu_s"]}
    out["repeats"] = [{k: v for k, v in r.items() if k != "cpu_s"} for r in repeats]
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _sum_dicts(dicts) -> dict:
    total: dict = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def legacy_ratios(results: dict, overhead: dict | None) -> dict:
    """The ratios of medians the benchmark has always had (balanced `auto`), for the
    workloads that ran, and the router overhead when measured."""
    ratios: dict = {}
    if "mixed" in results:
        mixed = results["mixed"]
        ratios.update({
            "disagg_itl_p99_vs_colocated": _ratio(mixed["disagg"]["itl_p99_ms"], mixed["colocated"]["itl_p99_ms"]),
            "disagg_short_itl_p99_vs_colocated": _ratio(mixed["disagg"].get("short_itl_p99_ms"),
                                                        mixed["colocated"].get("short_itl_p99_ms")),
            "auto_itl_p99_vs_colocated_mixed": _ratio(mixed["auto"]["itl_p99_ms"],
                                                      mixed["colocated"]["itl_p99_ms"]),
        })
    if "short_low_load" in results:
        short = results["short_low_load"]
        ratios["auto_ttft_p50_vs_colocated_short_low_load"] = _ratio(short["auto"]["ttft_p50_ms"],
                                                                     short["colocated"]["ttft_p50_ms"])
        for side in ("router", "worker"):  # where a client TTFT gap comes from: the route, or the path to it
            ratios[f"auto_{side}_ttft_p50_vs_colocated_short_low_load"] = _ratio(
                short["auto"].get(f"{side}_ttft_p50_ms"), short["colocated"].get(f"{side}_ttft_p50_ms"))
    for name, by_config in results.items():
        best = max((by_config[c]["goodput_rps"] or 0.0) for c in ("colocated", "disagg"))
        ratios[f"auto_goodput_vs_best_{name}"] = _ratio(by_config["auto"]["goodput_rps"], best)
    if overhead is not None:
        ratios["router_overhead_ttft_p50_ms"] = overhead["router_overhead_ttft_p50_ms"]
        if "router_overhead_vs_stream_p50_ms" in overhead:  # against the replica's worker stream
            ratios["router_overhead_vs_stream_p50_ms"] = overhead["router_overhead_vs_stream_p50_ms"]
    return ratios


def _met(value: float | None, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target


# ---- scenarios --------------------------------------------------------------------------


def score_scenarios(baseline, scenarios: dict) -> dict:
    scored = {}
    for name, scenario in scenarios.items():
        workload, runs = scenario["workload"], scenario["runs"]
        slos = cell_slos(baseline, BALANCED, [c.name for c in workload.classes])
        records = {config: r.records for config, r in runs.items()}
        if name == "disagg_hurts":
            scored[name] = score_disagg_hurts(records, slos, runs["auto"].fault_at_s)
        else:
            scored[name] = score_load_shift(records, slos, shift_at_s(workload))
    return scored


def _scenario_output(scenarios: dict, scored: dict) -> dict:
    out = {}
    for name, scenario in scenarios.items():
        runs = scenario["runs"]
        extra = {k: v for k, v in scenario.items() if k not in ("workload", "runs")}
        faults = {c: r.fault_at_s for c, r in runs.items() if r.fault_at_s is not None}
        delayed = {c: r.num_delayed_layers for c, r in runs.items() if r.num_delayed_layers is not None}
        out[name] = {**scored[name], **extra,
                     **({"fault_at_s": faults, "num_delayed_layers": delayed} if faults else {}),
                     "workload": scenario["workload"].describe(),
                     "figures": {c: {k: v for k, v in r.figures.items() if k != "cpu_s"} for c, r in runs.items()}}
    return out


# ---- the router's prediction error --------------------------------------------------------


def prediction_block(runs: dict, scenarios: dict) -> dict:
    """Over every `auto` run: the router's own median absolute percentage error per route
    (GET /admin/policy after each run, which covers that run alone), pooled as the median
    of the runs' medians weighted by their sample counts; per source (workload or scenario)
    the same; and beside it the load tester's, exact over all requests (client-side TTFT,
    so it includes the HTTP hop the router's prediction leaves out)."""
    from cluster.loadtest.predictions import prediction_error

    by_source = {name: [r for config, rs in by_config.items() if config.startswith("auto") for r in rs]
                 for name, by_config in runs.items()}
    by_source.update({name: [s["runs"]["auto"]] for name, s in scenarios.items()})
    every = [r for rs in by_source.values() for r in rs]
    return {"router_side": pool_errors([r.prediction_error for r in every]),
            "router_side_by_source": {name: pool_errors([r.prediction_error for r in rs])
                                      for name, rs in by_source.items()},
            "client_side": prediction_error([rec for r in every for rec in r.records]),
            "num_auto_runs": len(every),
            "repeat_spread": {name: spread_by_config(by_config) for name, by_config in runs.items()}}


def pool_errors(blocks: list[dict | None]) -> dict[str, dict]:
    """`{route: {ttft_mape, ttft_bias, ttft_samples, tpot_...}}` of several runs into one:
    the sample-weighted median of their medians (`_bias` where the runs reported it), and
    the samples summed."""
    blocks = [b for b in blocks if b]
    out: dict[str, dict] = {}
    for route in sorted({route for b in blocks for route in b}):
        for metric in PREDICTION_TARGETS:
            pairs = [(b[route][f"{metric}_mape"], b[route][f"{metric}_samples"]) for b in blocks
                     if f"{metric}_mape" in b.get(route, {})]
            value = weighted_median(pairs)
            if value is None:
                continue
            out.setdefault(route, {})[f"{metric}_mape"] = value
            out[route][f"{metric}_samples"] = sum(n for _, n in pairs)
            bias = weighted_median([(b[route][f"{metric}_bias"], b[route][f"{metric}_samples"]) for b in blocks
                                    if f"{metric}_bias" in b.get(route, {})])
            if bias is not None:
                out[route][f"{metric}_bias"] = bias
    return out


def weighted_median(pairs: list[tuple[float, int]]) -> float | None:
    """The lower weighted median of `(value, weight)` pairs; None without weight."""
    pairs = sorted((v, w) for v, w in pairs if w > 0)
    total, seen = sum(w for _, w in pairs), 0
    for value, weight in pairs:
        seen += weight
        if 2 * seen >= total:
            return value
    return None


def prediction_ratios(router_side: dict) -> dict[str, float]:
    return {f"prediction_{metric}_mape_{route}": block[f"{metric}_mape"]
            for route, block in router_side.items() for metric in PREDICTION_TARGETS if f"{metric}_mape" in block}


def spread_ratios(spread: dict) -> dict[str, float]:
    """Per workload, how far the same request landed apart between repeats of the `auto`
    configurations (`repeat_spread`): the machine's floor under the prediction error."""
    return {f"repeat_spread_{metric}_auto_{name}": by_config["auto*"][metric]
            for name, by_config in spread.items() for metric in PREDICTION_TARGETS
            if metric in by_config.get("auto*", {})}


def _prediction_limits(ratios: dict) -> dict[str, tuple[str, float]]:
    return {key: ("<=", limit) for key in ratios for metric, limit in PREDICTION_TARGETS.items()
            if key.startswith(f"prediction_{metric}_mape_")}


# ---- setup and the console table ----------------------------------------------------------


def cells_setup() -> dict:
    return {cell: {"ttft_x": ttft_x, "tpot_x": tpot_x} for cell, (ttft_x, tpot_x) in CELLS.items()}


def print_report(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title="bench cluster (medians over repeats; auto_<cell>: auto with that cell's SLOs)")
    for column in ("workload", "config", "TTFT p50", "ITL p99", "goodput/s", "goodput %", "routes"):
        table.add_column(column)
    for name, by_config in result["results"].items():
        for config, r in by_config.items():
            table.add_row(name, config, f"{r['ttft_p50_ms'] or 0:.1f}", f"{r['itl_p99_ms'] or 0:.1f}",
                          f"{r['goodput_rps'] or 0:.3f}", f"{100 * (r['goodput_fraction'] or 0):.0f}", str(r["routes"]))
    console.print(table)
    cells = Table(title="SLO cells: good requests pooled over repeats")
    for column in ("workload", "cell", "colocated", "disagg", "threshold", "auto", "best", "met"):
        cells.add_column(column)
    for name, by_cell in result["cells"].items():
        for cell, block in by_cell.items():
            good = block["good"]
            cells.add_row(name, cell, *(str(good.get(c, "-")) for c in ("colocated", "disagg", "threshold", "auto")),
                          block["best"], str(block["met"]))
    console.print(cells)
    for name, by_cell in result["cells"].items():
        for cell, block in by_cell.items():
            if block.get("route_split"):
                console.print(f"{name} {cell}, auto against {block['best']}: {describe(block['route_split'])}")
    for name, by_config in result["prediction"].get("repeat_spread", {}).items():
        spread = ", ".join(f"{config} TTFT {b.get('ttft', '-')} TPOT {b.get('tpot', '-')}"
                           for config, b in by_config.items())
        console.print(f"{name}: the same request between repeats lands apart by (median) {spread}")
    if result.get("machine_speed"):
        from cluster.bench.machine_speed import describe as describe_speed

        console.print(describe_speed(result["machine_speed"]))
    for key, target in result["targets"].items():
        verdict = {True: "met", False: "MISSED", None: "not judged"}[target["met"]]
        console.print(f"{key}: {target['value']} (target {target['target']}: {verdict})")
