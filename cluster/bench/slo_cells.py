"""SLO cells: every fixed configuration's runs scored against several SLOs, each `auto`
run against the one its profiles carried.

A cell states each class's SLO as multiples of the unloaded latencies the benchmark
measures (`cluster.bench.sizing.class_slo`): `balanced` is the 5x the workloads have always
used. The fixed configurations (`colocated`, `disagg`, `threshold`) route without looking
at the SLO, so their runs are re-scored in every cell from their requests.jsonl; `auto`
routes by the SLO, so it runs once per cell with that cell's SLOs in its workload profiles.

Good requests (each request against its own class's SLO, `meets_slo`: completed, TTFT and
TPOT within it) are pooled over repeats before any ratio. A cell's target: `auto` has at
least the best fixed configuration's good requests minus one. Where the best has fewer
than `MIN_BEST_GOOD` the cell says nothing (`met: null`): one request is then a large
share and the cell is too hard for anyone on this machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.bench.route_split import route_split
from cluster.bench.sizing import Baseline, class_slo
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO
from cluster.loadtest.metrics import meets_slo
from cluster.local.traffic import request_class

# cell -> (TTFT, TPOT) as multiples of the unloaded latencies
CELLS: dict[str, tuple[float, float]] = {
    "tight": (2.0, 2.0), "balanced": (5.0, 5.0), "loose": (10.0, 10.0),
    "tight_ttft": (2.0, 10.0), "tight_tpot": (10.0, 2.0),
}
BALANCED = "balanced"
FIXED_CONFIGS = ("colocated", "disagg", "threshold")
MIN_BEST_GOOD = 5
SLACK_REQUESTS = 1  # auto may have this many good requests fewer than the best
CELL_TARGET = f">= best fixed - {SLACK_REQUESTS} request (pooled over repeats)"


def auto_config(cell: str) -> str:
    """The configuration name of `auto` run with `cell`'s SLOs (`auto` itself: balanced)."""
    return "auto" if cell == BALANCED else f"auto_{cell}"


def cell_slos(b: Baseline, cell: str, class_names: Iterable[str]) -> dict[str, SLO]:
    ttft_x, tpot_x = CELLS[cell]
    return {name: class_slo(b, name, ttft_x, tpot_x) for name in class_names}


def num_good(records: Iterable[RequestRecord], slos: dict[str, SLO]) -> int:
    """Requests meeting their own class's SLO."""
    return sum(meets_slo(r, slos[request_class(r.request_id)]) for r in records)


def pooled(runs: Sequence[Sequence[RequestRecord]], slos: dict[str, SLO]) -> tuple[int, int]:
    """(good, sent) over every repeat's records."""
    return sum(num_good(rs, slos) for rs in runs), sum(len(rs) for rs in runs)


def compare(good: dict[str, int], sent: dict[str, int] | None = None) -> dict:
    """`auto`'s good requests against the best fixed configuration's (the first of the
    best on a tie): which was best, with how many, and the ratio."""
    best = max(FIXED_CONFIGS, key=lambda c: good.get(c, 0))
    block = {"good": dict(good), "best": best, "best_good": good.get(best, 0),
             "ratio": ratio(good.get("auto", 0), good.get(best, 0))}
    if sent is not None:
        block["sent"] = dict(sent)
    return block


def cell_met(block: dict) -> bool | None:
    """The cell target; None where the best fixed configuration had too few good requests."""
    if block["best_good"] < MIN_BEST_GOOD:
        return None
    return block["good"]["auto"] >= block["best_good"] - SLACK_REQUESTS


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def score_cells(b: Baseline, class_names: Sequence[str], runs: dict[str, list[list[RequestRecord]]]) -> dict:
    """`runs[config]`: each repeat's records, for the fixed configurations and for
    `auto_config(cell)` of every cell that ran. Per cell: its SLOs, good and sent
    requests per configuration (`auto` being that cell's run), the comparison, and
    `route_split` against the best (cluster/bench/route_split.py)."""
    cells = {}
    for cell in CELLS:
        if auto_config(cell) not in runs:
            continue
        slos = cell_slos(b, cell, class_names)
        counts = {c: pooled(runs[c], slos) for c in FIXED_CONFIGS if c in runs}
        counts["auto"] = pooled(runs[auto_config(cell)], slos)
        block = compare({c: g for c, (g, _) in counts.items()}, {c: n for c, (_, n) in counts.items()})
        split = route_split(runs[auto_config(cell)], runs[block["best"]], slos) if block["best"] in runs else None
        cells[cell] = {"slo": {name: slo.as_dict() for name, slo in slos.items()}, **block, "met": cell_met(block),
                       "route_split": split}
    return cells


def cell_ratios(workload: str, cells: dict) -> dict[str, float | None]:
    """`auto_goodput_vs_best_<workload>_<cell>` for every cell (the only keys with that
    prefix), and for `mixed`'s balanced cell auto against colocated and against disagg."""
    ratios = {f"auto_goodput_vs_best_{workload}_{cell}": block["ratio"] for cell, block in cells.items()}
    if workload == "mixed" and BALANCED in cells:
        good = cells[BALANCED]["good"]
        for config in ("colocated", "disagg"):
            ratios[f"auto_goodput_vs_{config}_mixed_{BALANCED}"] = ratio(good["auto"], good.get(config))
    return ratios


def cell_targets(workload: str, cells: dict) -> dict[str, dict]:
    return {f"auto_goodput_vs_best_{workload}_{cell}": {
        "target": CELL_TARGET, "value": block["ratio"], "met": block["met"],
        "auto_good": block["good"]["auto"], "best_good": block["best_good"], "best": block["best"]}
        for cell, block in cells.items()}
