"""How far the same request's TTFT and TPOT land apart when the same run is repeated: the
machine's own reproducibility, the yardstick beside the router's prediction error.

Every repeat of a configuration replays the same trace (the same prompts at the same
times), so a request id names the same request in each. For each pair of repeats and
each request that completed in both, the spread is |a - b| / b, the error a prediction
would have if it were the other repeat's measurement; the figure is the median over
requests and both orders of every pair. Two repeats each carry the machine's scatter
(which cores were free, which steps a prompt landed beside), so where that scatter is
independent between them, a model that knew everything but the scatter would land about
1/sqrt(2) of this figure off: a prediction error below that is not to be had on this
machine at this load.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from statistics import median

FIGURES = ("ttft", "tpot")


def repeat_spread(*groups: Sequence[Sequence]) -> dict[str, float | int]:
    """`{ttft, tpot, ttft_samples, tpot_samples}` over groups of repeats (each a list of
    the repeats' RequestRecords, one list per repeat), their pairs pooled; a figure is
    left out where no request completed in two repeats of a group."""
    indexed = [[{r.request_id: r for r in records if r.ok} for records in repeats] for repeats in groups]
    out: dict[str, float | int] = {}
    for figure in FIGURES:
        errors = [e for by_id in indexed for e in _pair_errors(by_id, figure)]
        if errors:
            out[figure] = round(median(errors), 4)
            out[f"{figure}_samples"] = len(errors)
    return out


def spread_by_config(runs: dict[str, list]) -> dict[str, dict]:
    """`{config: repeat_spread}` of one workload's runs (`{config: [RunResult per repeat]}`),
    and `auto*`, every `auto` configuration's pairs pooled (the runs whose predictions the
    router's error is measured on)."""
    out = {config: repeat_spread([r.records for r in rs]) for config, rs in runs.items()}
    autos = [[r.records for r in rs] for config, rs in runs.items() if config.startswith("auto")]
    if autos:
        out["auto*"] = repeat_spread(*autos)
    return {config: block for config, block in out.items() if block}


def _pair_errors(by_id: Sequence[dict], figure: str) -> list[float]:
    """|a - b| / b of `figure` for each request completed in two repeats (each repeat's
    records by request id), both ways round every pair."""
    errors = []
    for a, b in itertools.permutations(by_id, 2):
        for request_id, ra in a.items():
            rb = b.get(request_id)
            if rb is None:
                continue
            x, y = getattr(ra, f"{figure}_s"), getattr(rb, f"{figure}_s")
            if x and y and x > 0 and y > 0:
                errors.append(abs(x - y) / y)
    return errors
